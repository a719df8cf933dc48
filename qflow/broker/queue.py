"""Queues, their entries and consumers. No I/O.

A queue holds its available entries in FIFO order and counts every message
enqueued and not yet dequeued (available plus acquired-but-unaccepted): that
is its depth, ``msgDepth``/``byteDepth``, and what its limits are checked
against. It knows nothing of flow control or completion. It announces each
enqueue and dequeue to its observers: an op in the op log
(qflow.broker.oplog, which the completion applies: the accounting keeps its
own counts, as qpidd's QueueFlowLimit does, and decides), itself in the set of
queues with messages for their consumers, and the dequeued entries to the
outside holders it carries that watch dequeues (the store).
"""

from __future__ import annotations

import secrets
from collections import deque
from collections.abc import Sequence
from heapq import merge
from itertools import islice
from typing import Any, Protocol

from qflow.broker.oplog import OpLog
from qflow.broker.priority import PriorityEntries
from qflow.broker.settings import QueueSettings
from qflow.protocol.entries import (
    Entry,
    entry_tail,
    new_entry,
    properties_of,
    seq_and_size,
    seq_of,
    total_size,
)
from qflow.protocol.ranges import RangeSet

NEVER = 1 << 63  # an expiry later than any: nothing here expires


class CarriedHolder(Protocol):
    """An outside holder of completion as a queue that carries it sees it
    (qflow.broker.completion.Holder): told of the dequeues, if it asks."""

    name: str
    removed: bool
    dequeued: Any  # (queue, entries) -> None, or None


class Consumer:
    __slots__ = ("session", "destination", "queue", "accept_mode", "acquire_mode", "credit", "byte_credit", "cursor",
                 "write", "delivered", "maps_amqp")

    def __init__(self, session: Any, destination: str, queue: Queue, accept_mode: int, acquire_mode: int) -> None:
        self.session = session
        self.destination = destination
        self.queue = queue
        self.accept_mode = accept_mode
        self.acquire_mode = acquire_mode
        self.credit = 0  # messages; -1 = unlimited
        self.byte_credit = 0  # bytes; -1 = unlimited
        self.cursor = 0  # a browser's next sequence number to deliver
        self.delivered = 0  # messages delivered, counted per batch (qpid-stat -u's "delivered")
        # write(first_delivery_id, entries): its deliveries, as its session's output encodes them
        self.write = session.out.deliveries(destination)
        # A qflow consumer gets an AMQP 1.0 message mapped (qflow.protocol.amqp.entries.qflow_entry);
        # a 1.0 consumer's output maps what it needs itself.
        self.maps_amqp = True


class Queue:
    __slots__ = (
        "name", "durable", "exclusive", "auto_delete", "arguments", "settings", "owner", "slot", "oplog",
        "ready", "entries", "consumers", "next_consumer", "count", "nbytes", "next_seq",
        "total_dequeues", "byte_total_dequeues", "max_count", "max_size", "ring",
        "discards_ring", "discards_overflow", "binding_count", "had_consumer", "deleted",
        "route", "browsers", "holders", "special", "incarnation", "amqp", "delivery_failures",
        "stamps", "expiries", "next_expiry", "discards_ttl", "dead_letters",
    )

    def __init__(
        self, name: str, durable: bool, exclusive: bool, auto_delete: bool, arguments: dict[str, Any],
        settings: QueueSettings, slot: int, oplog: OpLog, ready: dict[Queue, None], owner: Any = None,
    ) -> None:
        self.name = name
        self.durable = durable
        self.exclusive = exclusive
        self.auto_delete = auto_delete
        self.arguments = arguments
        self.settings = settings
        self.max_count = settings.max_count  # copied from settings for the per-message path
        self.max_size = settings.max_size
        self.ring = settings.is_ring
        self.holders: tuple[CarriedHolder, ...] = ()  # outside holders of the transfers routed here
        # A ring queue, or one with outside holders: the per-message path tests this one flag
        # for both, so that a queue with neither costs no more for their existence.
        # A queue whose messages are stamped on arrival (a default ttl, priority levels) takes
        # the broker's general path; it is special for that one test too.
        self.stamps = bool(settings.ttl or settings.levels)
        self.special = self.ring or self.stamps
        # The expiry (ms since the epoch) of each message here that has one, by sequence number
        # (those dequeued leave it), and the earliest of them, or later: see expired().
        self.expiries: dict[int, int] = {}
        self.next_expiry = NEVER
        self.discards_ttl = 0  # messages that expired here (qpidd's discardsTtl)
        self.dead_letters = 0  # messages that left here as dead letters, to the alternate exchange or not
        self.owner = owner
        self.slot = slot  # the accounting's number for it
        self.oplog = oplog  # where it announces enqueues and dequeues
        self.ready = ready  # where it announces new messages for its consumers
        # A priority queue's entries are by level (qflow.broker.priority), chosen here once.
        self.entries: Any = PriorityEntries(max(settings.levels) + 1, self.level_of) if settings.levels else deque()
        self.consumers: list[Consumer] = []  # they acquire: each message goes to one
        self.browsers: list[Consumer] = []  # they see every message and take none
        self.next_consumer = 0
        self.count = 0
        self.nbytes = 0
        self.next_seq = 1
        self.total_dequeues = 0
        self.byte_total_dequeues = 0
        self.discards_ring = 0
        self.discards_overflow = 0
        self.binding_count = 1  # the default exchange's binding
        self.had_consumer = False
        self.deleted = False
        self.route = (self,)  # the default exchange's routing result, made once
        # Names this queue object: a queue deleted and declared again (or recovered
        # by a restart) numbers its messages afresh, so a reader that remembers
        # sequence numbers must also remember whose they are.
        self.incarnation = secrets.token_hex(8)
        # AMQP 1.0 producers have written to it: its entries may hold 1.0 messages, which a
        # qflow consumer gets mapped (a queue only qflow clients use pays nothing for it).
        self.amqp = False
        # Sequence number -> the delivery-count a 1.0 consumer's ``modified`` outcome with
        # delivery-failed gave the message (its entry, counted in the queue's bytes, is not rewritten).
        self.delivery_failures: dict[int, int] = {}

    def set_settings(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.max_count = settings.max_count
        self.max_size = settings.max_size
        self.ring = settings.is_ring
        self.stamps = bool(settings.ttl or settings.levels)
        self.special = self.ring or self.stamps or bool(self.holders)

    # -- outside holders ------------------------------------------------------
    def add_holder(self, holder: CarriedHolder) -> None:
        """From now on ``holder`` holds each transfer routed here (qflow.broker.completion.Holder)."""
        if holder.removed:
            raise ValueError(f"queue {self.name!r}: holder {holder.name!r} was removed")
        if holder not in self.holders:
            self.holders = (*self.holders, holder)
            self.special = True

    def remove_holder(self, holder: CarriedHolder) -> None:
        """From now on ``holder`` does not hold the transfers routed here; the
        holds it has keep until it releases them."""
        self.holders = tuple(h for h in self.holders if h is not holder)
        self.special = self.ring or self.stamps or bool(self.holders)

    @property
    def total_enqueues(self) -> int:
        return self.next_seq - 1  # every enqueue took one sequence number

    @property
    def byte_total_enqueues(self) -> int:
        return self.byte_total_dequeues + self.nbytes

    # -- enqueue and dequeue, announced -----------------------------------------
    def enqueue(self, tail: bytes, size: int, session: int = -1, command_id: int = 0) -> int:
        """Append one message (``tail``: its encoding after an entry's head, and
        ``size``: its size, see qflow.protocol.entries) and announce it; returns its
        sequence number. With a ``session``, the op is also the whole transfer
        ``command_id`` of that session (one destination: OP_TRANSFER1); without,
        it belongs to the transfer the caller has opened in the log. A ring
        queue may now be over its limit: the caller trims it (:meth:`trim_ring`)
        once the transfer is closed."""
        seq = self.next_seq
        self.next_seq = seq + 1
        self.entries.append(new_entry(seq, size, tail))
        self.count += 1
        self.nbytes += size
        if self.consumers or self.browsers:
            self.ready[self] = None
        if session >= 0:
            self.oplog.transfer1(session, command_id, self.slot, size, seq)
        else:
            self.oplog.enqueue(self.slot, size, seq)
        return seq

    def level_of(self, entry: Entry) -> int:
        """A priority queue's level for ``entry``, from its ``priority`` property."""
        priority = (properties_of(entry) or {}).get("priority")
        return self.settings.default_level if priority is None else self.settings.levels[priority]

    def enqueue_at(self, level: int, tail: bytes, size: int) -> int:
        """:meth:`enqueue` (in the transfer the caller opened, or outside any) at
        ``level`` of a priority queue; returns the message's sequence number."""
        seq = self.next_seq
        self.next_seq = seq + 1
        self.entries.append_at(level, new_entry(seq, size, tail))
        self.count += 1
        self.nbytes += size
        if self.consumers or self.browsers:
            self.ready[self] = None
        self.oplog.enqueue(self.slot, size, seq)
        return seq

    def first_sequence(self) -> int:
        """The sequence number of the oldest message available here, or the next one's."""
        entries = self.entries
        if not entries:
            return self.next_seq
        if self.settings.levels:
            return min(seq_of(level[0]) for level in entries.levels if level)
        return seq_of(entries[0])

    def enqueue_run(self, entries: list[Entry], nbytes: int) -> None:
        """Append entries made by the transfer scanner (qflow.broker.transfer_runs),
        whose announcements it wrote (the caller hands them to the op log)."""
        n = len(entries)
        self.next_seq += n
        self.entries.extend(entries)
        self.count += n
        self.nbytes += nbytes
        if self.consumers or self.browsers:
            self.ready[self] = None

    def restore(self, entries: list[Entry]) -> None:
        """Put back messages recovered from the durable store, in sequence order,
        before anything else is enqueued. Each is announced as an enqueue outside
        any transfer: the flow limit counts it (a queue recovered above its stop
        threshold starts with flow on) and nothing is held. Numbering goes on
        after the last one, so a new message never takes a stored one's number."""
        if self.next_seq != 1 or self.entries:
            raise ValueError(f"queue {self.name!r}: restore() after messages were enqueued")
        enqueue, slot = self.oplog.enqueue, self.slot
        nbytes = 0
        for entry in entries:
            seq, size = seq_and_size(entry)
            nbytes += size
            enqueue(slot, size, seq)
        if self.settings.levels:
            for entry in entries:
                self.entries.append_at(self.level_of(entry), entry)
        else:
            self.entries.extend(entries)
        self.count += len(entries)
        self.nbytes += nbytes
        for entry in entries:
            if b"expiration" in entry:  # bytes of the body may say so too: then properties tell
                expiration = (entry_tail(entry)[2] or {}).get("expiration")
                if type(expiration) is int:
                    self.note_expiry(seq_of(entry), expiration)
        if entries:
            self.next_seq = seq_of(entries[-1]) + 1
            if self.consumers or self.browsers:
                self.ready[self] = None

    def dequeue(self, entry: Entry) -> None:
        """Remove one message for good (accepted, purged, overwritten) and announce it
        (to the op log and to the outside holders that watch dequeues)."""
        size = seq_and_size(entry)[1]
        self.count -= 1
        self.nbytes -= size
        self.total_dequeues += 1
        self.byte_total_dequeues += size
        self.oplog.dequeue(self.slot, entry)
        if self.holders:
            self._tell_holders((entry,))
        if self.expiries:
            self.expiries.pop(seq_of(entry), None)
        if self.delivery_failures:
            self.delivery_failures.pop(seq_of(entry), None)

    def _tell_holders(self, entries: Sequence[Entry]) -> None:
        for holder in self.holders:
            if holder.dequeued is not None:
                holder.dequeued(self, entries)

    def dequeue_many(self, entries: list[Entry]) -> None:
        """Dequeue several, announced together; the outside holders that watch
        dequeues are told of all of them at once."""
        if self.holders:
            self._tell_holders(entries)
        if self.expiries:
            pop = self.expiries.pop
            for entry in entries:
                pop(seq_of(entry), None)
        if self.delivery_failures:  # whatever takes them away (an accept, a purge, an expiry): counted no more
            pop = self.delivery_failures.pop
            for entry in entries:
                pop(seq_of(entry), None)
        n, nbytes = len(entries), total_size(entries)
        if n:
            self.count -= n
            self.nbytes -= nbytes
            self.total_dequeues += n
            self.byte_total_dequeues += nbytes
            self.oplog.dequeue_many(self.slot, entries, nbytes)

    def trim_ring(self) -> list[Entry]:
        """A ring queue over its limit drops its oldest available messages;
        returns them (dequeued: the broker sends them to the alternate exchange)."""
        s = self.settings
        entries = self.entries
        dropped = []
        # A priority queue drops the oldest of its lowest level.
        pop = entries.pop_lowest if s.levels else entries.popleft
        while entries and ((s.max_count and self.count > s.max_count) or (s.max_size and self.nbytes > s.max_size)):
            entry = pop()
            self.dequeue(entry)
            dropped.append(entry)
            self.discards_ring += 1
        return dropped

    # -- expiry ---------------------------------------------------------------
    def note_expiry(self, seq: int, expiration: int) -> None:
        """Message ``seq`` (enqueued) expires at ``expiration`` (ms since the Unix epoch)."""
        self.expiries[seq] = expiration
        if expiration < self.next_expiry:
            self.next_expiry = expiration

    def expired(self, now: int) -> RangeSet:
        """The sequence numbers of the messages here (available or acquired) whose
        expiry is ``now`` or earlier. Looks at every message with an expiry, so
        the broker asks only once ``next_expiry`` is due, which this updates."""
        due = RangeSet()
        later = NEVER
        for seq, expiration in self.expiries.items():
            if expiration <= now:
                due.add(seq)
            elif expiration < later:
                later = expiration
        self.next_expiry = later
        return due

    def put_back(self, entry: Entry) -> None:
        """Return an acquired entry to its place in FIFO order (release, session close)."""
        self.put_back_many([entry])

    def put_back_many(self, returned: list[Entry]) -> None:
        """Return acquired entries, in sequence order, each to its place in FIFO
        order. Only the available entries older than the newest returned one
        are merged with them (those were put back earlier: a delivery takes
        the oldest), so a session's close costs per message it returns, not
        per message it returns times the queue's depth."""
        if not returned:
            return
        self.ready[self] = None
        if self.expiries:
            self.next_expiry = 0  # those that expired while acquired go at the next delivery
        entries = self.entries
        if self.settings.levels:
            entries.put_back(returned)
            return
        newest = seq_of(returned[-1])
        if entries and seq_of(entries[0]) < newest:
            older = []
            while entries and seq_of(entries[0]) < newest:
                older.append(entries.popleft())
            returned = list(merge(older, returned, key=seq_of))
        entries.extendleft(reversed(returned))

    # -- reading by sequence number (a browsing reader's plan and commit) -------------
    def _index_after(self, after: int) -> int:
        """Index of the first available entry with a sequence number above ``after``
        (entries are kept in sequence order)."""
        entries = self.entries
        lo, hi = 0, len(entries)
        while lo < hi:
            mid = (lo + hi) // 2
            if seq_of(entries[mid]) <= after:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def available(self, after: int, limit: int = -1) -> RangeSet:
        """The sequence numbers of the first ``limit`` (-1: all) available
        messages numbered above ``after``. Acquired ones are not available."""
        out = RangeSet()
        self.available_slice(out, after, limit, len(self.entries) + 1)
        return out

    def available_slice(self, out: RangeSet, after: int, limit: int, most: int) -> tuple[int, int, bool]:
        """One bounded step of :meth:`available`: add to ``out`` the sequence
        numbers of at most ``most`` (and ``limit``, unless -1) available
        messages above ``after``. Returns (how many, the last one added or
        ``after``, whether there may be more)."""
        if limit == 0:
            return 0, after, False
        take = most if limit < 0 else min(most, limit)
        add = out.add
        n = 0
        last = after
        if self.settings.levels:
            following: Any = (e for e in self.entries.in_sequence() if seq_of(e) > after)
        else:
            following = islice(self.entries, self._index_after(after), None)
        for entry in following:
            last = seq_of(entry)
            add(last)
            n += 1
            if n == take:
                return n, last, n < limit or limit < 0
        return n, last, False

    def remove_sequences(self, sequences: RangeSet) -> int:
        """Dequeue exactly the available messages whose sequence numbers are in
        ``sequences``; any other stays where it is. Returns how many went."""
        if not sequences:
            return 0
        ranges = list(sequences.ranges())
        removed, _, _ = self.remove_sequences_slice(sequences, ranges[0][0], ranges[-1][1], len(self.entries) + 1)
        return removed

    def remove_sequences_slice(self, sequences: RangeSet, first: int, last: int, most: int) -> tuple[int, int, bool]:
        """One bounded step of :meth:`remove_sequences`: look at no more than
        ``most`` available messages numbered ``first`` to ``last``, and dequeue
        those in ``sequences``. Returns (how many went, the number to go on
        from, whether messages up to ``last`` may be left to look at)."""
        removed, nxt, more = self.take_sequences_slice(sequences, first, last, most)
        if removed:
            self.dequeue_many(removed)
        return len(removed), nxt, more

    def take_sequences_slice(self, sequences: RangeSet, first: int, last: int,
                             most: int) -> tuple[list[Entry], int, bool]:
        """:meth:`remove_sequences_slice`, but the entries taken out are
        returned, not dequeued: the caller dequeues them (as dead letters)."""
        entries = self.entries
        if not entries or first > last:
            return [], first, False
        if self.settings.levels:
            return entries.take(lambda seq: seq <= last and seq in sequences, most, first)
        i = self._index_after(first - 1)
        entries.rotate(-i)
        removed: list[Entry] = []
        kept: list[Entry] = []
        seen = 0
        nxt = first
        while entries and seen < most and (nxt := seq_of(entries[0])) <= last:
            entry = entries.popleft()
            (removed if nxt in sequences else kept).append(entry)
            seen += 1
            nxt += 1
        more = seen == most and bool(entries) and seq_of(entries[0]) <= last
        entries.extendleft(reversed(kept))
        entries.rotate(i)
        return removed, nxt, more

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "durable": self.durable,
            "autoDelete": self.auto_delete,
            "exclusive": self.exclusive,
            "arguments": self.arguments,
            "msgDepth": self.count,
            "byteDepth": self.nbytes,
            "msgTotalEnqueues": self.total_enqueues,
            "msgTotalDequeues": self.total_dequeues,
            "byteTotalEnqueues": self.byte_total_enqueues,
            "byteTotalDequeues": self.byte_total_dequeues,
            "consumerCount": len(self.consumers) + len(self.browsers),
            "bindingCount": self.binding_count,
            "discardsRing": self.discards_ring,
            "discardsOverflow": self.discards_overflow,
            "discardsTtl": self.discards_ttl,
            "deadLetters": self.dead_letters,
            "maxCount": self.settings.max_count,
            "maxSize": self.settings.max_size,
            "policyType": self.settings.policy,
            "firstSequence": self.first_sequence(),
            "lastSequence": self.next_seq - 1,
            "incarnation": self.incarnation,
        }
