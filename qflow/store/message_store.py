"""The durable store as an outside holder of transfers' completion
(qflow.broker.completion; docs/architecture.md). No trio, no I/O of
its own: the journal (qflow.store.journal) does the writing, and the server's
store task (qflow.server.store_task) runs its sync in a worker thread.

Every durable queue carries the store's holder. A transfer routed to one is
held until the store lets go: at once if the message is transient (it must
not wait for the disk), after the commit that makes it durable if it is
persistent (message property ``"durable": true``, as qflow.client.sender sets
it). Every dequeue from a durable queue (accept, purge, ring overwrite,
remove-through) is staged as a removal and rides along with the next commit:
removal is lazy, and a removal lost in a crash means a redelivery.

The cycle, all on the event loop except ``write_and_sync``::

    holder woken (inside an apply)     -> wake(): only a signal; nothing may be released mid-apply
    commit = store.prepare()           -> stages the holds that arrived, releases the transient ones
                                          (Broker.release_holds: they complete at once)
    journal.write_and_sync(commit.batch)     (worker thread)
    store.finish(commit)               -> the persistent transfers complete, unless the journal is
                                          overfull (qflow.store.quota): then they stay held until
                                          a commit brings it below underfull
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import itemgetter, not_
from typing import TYPE_CHECKING

import msgpack

from qflow.protocol.entries import ENTRY_HEAD_SIZE, Entry, properties_at, scan_entries, seq_of
from qflow.store.journal import Batch, Journal
from qflow.store.quota import QuotaLimits, StoreQuota

if TYPE_CHECKING:
    from qflow.broker.broker import Broker
    from qflow.broker.completion import Held
    from qflow.broker.queue import Queue

log = logging.getLogger("qflow.store")


_ONLY_DURABLE = msgpack.packb({"durable": True})
_seq_tuple = struct.Struct(">2xQ").unpack_from  # (seq,) of an entry: map()ped with no Python call per entry


def is_persistent(entry: Entry) -> bool:
    """Whether the message stored as ``entry`` has the property ``"durable": true``.
    The properties map is found without decoding anything else (it lies between
    the routing key and the body's bin header), and is decoded only if it
    mentions ``durable``: a transient message costs two length reads, a scan
    for its body and a substring search; what a durable sender sends, two
    length reads and one comparison."""
    props = properties_at(entry)
    if entry[props] == 0xC0:  # nil: no properties
        return False
    if entry.startswith(_ONLY_DURABLE, props):
        # A map of one pair, "durable": true: what the client sends for durable=True and nothing else.
        # (What follows it can only be the body's bin header.)
        return True
    # The head's size counts the message's header, not its body's length
    # (qflow.protocol.entries.message_size): the scan says where the body starts.
    region = entry[props:scan_entries(entry, 1)[1]]  # the properties, then the body's bin header
    if b"durable" not in region:
        return False
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(region)
    properties = unpacker.unpack()
    return isinstance(properties, dict) and properties.get("durable") is True


@dataclass
class Commit:
    """One commit handed to the worker: the journal's batch (None when only
    transfers with nothing left to write wait) and the holds it releases."""

    batch: Batch | None
    tokens: list[int]


# The name a session held by the store's quota is told (session.flow-notice, heldBy).
DISK_QUOTA = "store disk quota"


class MessageStore:
    """``journal`` (recovered already) made the holder of ``broker``'s durable
    queues. ``wake`` is called, on the loop, whenever there is something to
    commit; it must only signal (it may be called inside the broker's apply).
    ``quota`` is the disk quota (qflow.store.quota): while the journal is
    overfull, synced persistent transfers stay held until it is underfull."""

    def __init__(self, broker: Broker, journal: Journal, wake: Callable[[], None] | None = None,
                 quota: QuotaLimits | None = None) -> None:
        self.broker = broker
        self.journal = journal
        self._wake = wake or (lambda: None)
        self.quota = StoreQuota(quota or QuotaLimits())
        self.quota.update(journal.size_on_disk())  # a recovered journal may be overfull already
        self._quota_held: list[int] = []  # synced while overfull, in commit order: released when underfull
        # It tracks: once overfull, the sessions of the holds it has then are named too.
        self.holder = broker.add_holder("store", wake=self._wake, dequeued=self._dequeued, deleted=self._deleted,
                                        tracks=True)
        if self.quota.overfull:
            broker.name_holder(self.holder, DISK_QUOTA)
            self._compact()  # recovered over quota: what was consumed before the stop may be enough to clear it
        self._waiting: list[int] = []  # holds of transfers staged since the last prepare()
        self._now: list[int] = []  # holds to let go of at the next prepare(): transient, or gone already
        # Queue name -> sequence numbers dequeued before their hold was staged (and transient ones: see _dequeued)
        self._early: dict[str, set[int]] = {}
        self._persistent_head = b"\xff"  # see _is_persistent (0xff starts no entry's exchange)
        self._orphans: dict[str, list[Entry]] = {}  # recovered for a queue not declared (durable) at restore()
        broker.carry(self.holder, _is_durable, self._attached)

    def restore(self, recovered: dict[str, list[Entry]]) -> None:
        """Put the journal's recovered messages (``Journal.recover()``) back on
        their queues, which must be declared already and empty, then apply: depth,
        bytes and flow state are recomputed. Messages of a queue that is not
        declared stay in the journal (a configuration error must not destroy
        them) and are logged; they go back on the queue if a durable queue of
        that name is declared later (see attach)."""
        for name, entries in recovered.items():
            q = self.broker.queues.get(name)
            if q is None or not q.durable:
                log.error("store: %d recovered messages for queue %r, which is %s: kept in the journal, "
                          "not delivered until a durable queue %r is declared", len(entries), name,
                          "not declared" if q is None else "not durable", name)
                self._orphans[name] = entries
                continue
            q.restore(entries)
        self.broker.flush()

    def _attached(self, q: Queue) -> None:
        """Durable queue ``q`` carries the store now: messages the journal kept
        for a queue of its name go back on it."""
        orphans = self._orphans.pop(q.name, None)
        if orphans:
            # The journal still holds these under this name, so the new queue must own them: else
            # its own numbering (from 1) would collide with theirs in the journal.
            q.restore(orphans)
            log.warning("store: durable queue %r declared: its %d messages kept in the journal are back on it",
                        q.name, len(orphans))
            self._wake()  # the committer's flush applies the restored enqueues

    def _deleted(self, q: Queue) -> None:
        if q.durable:
            self.journal.delete_queue(q.name)
            # A queue of that name declared before the next prepare() numbers its messages from 1
            # again: the deleted one's early dequeues must not keep them out of the journal.
            self._early.pop(q.name, None)
            self._wake()

    def _dequeued(self, q: Queue, entries: Sequence[Entry]) -> None:
        name = q.name
        missing = self.journal.dequeue_many(name, entries)
        if missing:
            # Transient, or dequeued before its enqueue was staged (its hold not taken yet, or not
            # even given: a ring overwrite in the transfer's own input batch): then the enqueue
            # must not be staged at all, or a crash would bring back a message that was removed.
            # Which of the two is not asked: only a persistent message's enqueue looks here, and
            # the set is emptied at every prepare().
            early = self._early.get(name)
            if early is None:
                self._early[name] = set(missing)
            else:
                early.update(missing)
        self._wake()

    def _stage_arrivals(self) -> None:
        """Stage the holds given since the last call; the others wait in ``_now``
        (released by prepare(): not here, which may run in the middle of a batch)."""
        for q, tokens, entries, seqs in self.holder.take_runs():  # the usual input: no Python call per transfer
            # One run of transfer frames: the same properties but for a message id, so the first
            # message says whether all are persistent (completion.HeldRun).
            if self._is_persistent(entries[0]):
                self._stage_run(q, entries, tokens, seqs)
            else:
                self._now += tokens
        held = self.holder.take()
        if not held:
            return
        if self._stage_uniform(held):
            return
        early, journal, now = self._early, self.journal, self._now
        head = self._persistent_head
        run_queue: Queue | None = None  # a run of persistent transfers to one queue, staged in one call
        run: list[Entry] = []
        tokens: list[int] = []
        for token, messages in held:
            # A transfer's messages are one message routed to several queues: one test says for all.
            entry = messages[0][1]
            if not entry.startswith(head, ENTRY_HEAD_SIZE):  # _is_persistent's first test, inlined
                if not self._is_persistent(entry):
                    now.append(token)
                    continue
                head = self._persistent_head
            if len(messages) == 1:  # the usual case
                q = messages[0][0]
                if q is not run_queue:
                    if run:
                        self._stage_run(run_queue, run, tokens)  # type: ignore[arg-type]
                        run, tokens = [], []
                    run_queue = q
                run.append(entry)
                tokens.append(token)
                continue
            if run:  # staged in arrival order
                self._stage_run(run_queue, run, tokens)  # type: ignore[arg-type]
                run, tokens, run_queue = [], [], None
            placements = [(q.name, e) for q, e in messages]
            if early:
                placements = [p for p in placements if seq_of(p[1]) not in early.get(p[0], ())]
            if placements:
                journal.enqueue_fanout(placements)
                self._waiting.append(token)
            else:
                now.append(token)
        if run:
            self._stage_run(run_queue, run, tokens)  # type: ignore[arg-type]

    def _stage_uniform(self, held: list[Held]) -> bool:
        """The usual input, staged with no Python call per transfer: every
        transfer one message, to one queue, and persistent by the last persistent
        message's test (see _is_persistent). False, with nothing done, otherwise."""
        tokens, messages = zip(*held, strict=True)
        if len(held) > 1 and (max(map(len, messages)) != 1):
            return False
        if len(messages[0]) != 1:
            return False
        queues, entries = zip(*map(itemgetter(0), messages), strict=True)
        q = queues[0]
        if queues.count(q) != len(queues):
            return False
        try:
            if not all(map(bytes.startswith, entries, repeat(self._persistent_head), repeat(ENTRY_HEAD_SIZE))):
                return False
        except TypeError:  # an entry that is not bytes: the general path takes it
            return False
        self._stage_run(q, list(entries), list(tokens))
        return True

    def _stage_run(self, q: Queue, entries: list[Entry], tokens: list[int], seqs: Sequence[int] | None = None) -> None:
        """Stage a run of persistent messages to ``q``, one per transfer (``tokens``;
        ``seqs``: their sequence numbers, if known), but those dequeued already:
        their holds are let go at once."""
        early = self._early.get(q.name)
        if early:
            if seqs is None:
                seqs = [seq for (seq,) in map(_seq_tuple, entries)]
            if not early.isdisjoint(seqs):
                gone = list(map(early.__contains__, seqs))
                self._now += compress(tokens, gone)
                keep = list(map(not_, gone))
                tokens = list(compress(tokens, keep))
                entries = list(compress(entries, keep))
                seqs = list(compress(seqs, keep))
                if not entries:
                    return
        self._waiting += tokens
        self.journal.enqueue_run(q.name, entries, seqs)

    def _is_persistent(self, entry: Entry) -> bool:
        """is_persistent, with the answer for the last persistent message's
        exchange, routing key and properties kept: a message whose bytes after
        the head start with those same bytes is persistent too (msgpack is
        self-delimiting: the same bytes decode to the same fields), so a run
        of a durable sender's messages costs one comparison each."""
        if entry.startswith(self._persistent_head, ENTRY_HEAD_SIZE):
            return True
        if not is_persistent(entry):
            return False
        props = properties_at(entry)
        if entry.startswith(_ONLY_DURABLE, props):
            self._persistent_head = entry[ENTRY_HEAD_SIZE:props + len(_ONLY_DURABLE)]
        return True

    def prepare(self) -> Commit | None:
        """On the loop, between input batches: stage what arrived, release the
        transient transfers' holds (they complete now, not after the sync), and
        take the next commit; None if there is nothing to write or wait for."""
        self._stage_arrivals()
        self._early.clear()  # every hold given before this point has been staged above
        if self._now:
            now, self._now = self._now, []
            self.broker.release_holds(self.holder, now)
        batch = self.journal.take_staged()
        if batch is None and not self._waiting:
            return None
        commit = Commit(batch, self._waiting)
        self._waiting = []
        return commit

    def finish(self, commit: Commit) -> None:
        """On the loop, after ``journal.write_and_sync(commit.batch)`` returned:
        the persistent transfers are durable: they complete now, unless the
        store's quota holds them (overfull) or something else does."""
        if commit.batch is not None:
            self.journal.committed(commit.batch)
        quota = self.quota
        released: list[int] = []
        # The size is checked after each commit, as the Java broker checks after each transaction: what
        # was in flight when the limit was crossed is written anyway (best effort), and held from then on.
        if quota.update(self.journal.size_on_disk()):
            if quota.overfull:  # the sessions held from now on are told by whom
                self.broker.name_holder(self.holder, DISK_QUOTA)
            else:
                released, self._quota_held = self._quota_held, []
                self.broker.name_holder(self.holder, None)
        if quota.overfull:
            self._quota_held += commit.tokens
            self._compact()
        else:
            released += commit.tokens
        self.broker.release_holds(self.holder, released)

    def _compact(self) -> None:
        """Overfull: if rewriting what is live would bring the journal under the
        underfull limit, have the next commit do it (Journal.compact_to_fit), and
        ask for that commit now: nothing else may come to commit."""
        if self.journal.compact_to_fit(self.quota.limits.resume):
            self._wake()

    def stats(self) -> dict[str, int | bool]:
        """storeSize (bytes on disk after the last commit), storeOverfull, storeOverfullCount."""
        return self.quota.stats()

    def commit_inline(self) -> None:
        """prepare, write, sync and finish on the calling thread (tests and
        tools: it blocks for the sync)."""
        commit = self.prepare()
        if commit is not None:
            if commit.batch is not None:
                try:
                    self.journal.write_and_sync(commit.batch)
                except BaseException:
                    self.journal.committed(commit.batch)
                    raise
            self.finish(commit)

    def close(self) -> None:
        """Stop holding: every transfer still held completes unless something else holds it
        (call only after the last commit, or persistent transfers complete undurably)."""
        self.broker.remove_holder(self.holder)


def _is_durable(q: Queue) -> bool:
    """The store holds the transfers of durable queues only."""
    return q.durable
