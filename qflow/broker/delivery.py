"""Delivery: from a queue's head to its consumers, as their credit allows,
and to its browsers. No I/O.

The per-message path: the entries a consumer's credit allows are taken off
the queue as one batch and handed to the consumer's writer, which its
session's output made (qflow.protocol.session_output: how they become frames
is the protocol's business). Deliveries that need no accept are dequeued at
once; the others wait in the session's unacked lists for message.accept.

A consumer gets no more than its connection's output has room for
(``SessionOutput.room``), whatever its credit: a peer that stops reading
stops receiving, and its messages stay in the queue, counted in its depth.
The room is checked once per batch, and a queue whose consumer had none is
noted in ``stalled``, to be dispatched again once output drains
(Broker.output_drained).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from itertools import accumulate, islice, repeat, starmap
from typing import Any

from qflow.broker.queue import Consumer, Queue
from qflow.broker.session import BrokerSession
from qflow.protocol import ACCEPT_EXPLICIT
from qflow.protocol.amqp.entries import qflow_entry
from qflow.protocol.entries import Entry, seq_and_size, seq_of


class Delivery:
    """Delivers for every queue; ``dirty`` collects the sessions given deliveries."""

    def __init__(self, dirty: dict[BrokerSession, None], stalled: dict[Queue, None],
                 expire: Callable[[Queue], None]) -> None:
        self.dirty = dirty
        self.stalled = stalled  # queues left undelivered for want of output room
        self.expire = expire  # drops a queue's expired messages (Broker._expire_for_delivery)

    def dispatch(self, q: Queue) -> None:
        """Deliver what ``q`` has to its browsers and consumers, as their credit
        allows. A queue with messages that expire drops the expired ones first:
        no consumer nor browser is given one."""
        if q.expiries:
            self.expire(q)
        for c in q.browsers:
            self._browse(c, q)
        entries = q.entries
        consumers = q.consumers
        if len(consumers) == 1:
            self._deliver(consumers[0], q, -1)
            return
        while entries and consumers:  # round robin, one message at a time
            n = len(consumers)
            size = seq_and_size(entries[0])[1]
            for _ in range(n):
                c = consumers[q.next_consumer % n]
                q.next_consumer += 1
                if c.credit != 0 and (c.byte_credit < 0 or c.byte_credit >= size) and c.session.out.room() > 0:
                    break
            else:
                if any(c.session.out.room() <= 0 for c in consumers):
                    self.stalled[q] = None
                return
            self._deliver(c, q, 1)

    def _browse(self, c: Consumer, q: Queue) -> None:
        """Deliver copies of the entries from the browser's cursor on, as credit allows."""
        entries = q.entries
        if not entries or seq_of(entries[-1]) < c.cursor or c.credit == 0:
            return
        cursor = c.cursor
        if q.settings.levels:  # a priority queue is browsed in sequence order too
            following: Any = (e for e in entries.in_sequence() if seq_of(e) >= cursor)
        else:
            following = islice(entries, bisect_left(entries, cursor, key=seq_of), None)
        ssn = c.session
        room = ssn.out.room()
        if room <= 0:
            self.stalled[q] = None
            return
        untracked = bool(ssn.unacked)
        batch: list[Entry] = []
        # Iterate, never index: indexing a deque far from its ends walks its
        # blocks, which made a browser deep in a long queue cost O(depth) per message.
        nbytes = 0
        for e in following:
            if c.credit == 0:
                break
            if nbytes >= room:
                self.stalled[q] = None
                break
            nbytes += len(e)
            seq, size = seq_and_size(e)
            if c.byte_credit >= 0:
                if c.byte_credit < size:
                    break
                c.byte_credit -= size
            if c.credit > 0:
                c.credit -= 1
            batch.append(e)
            c.cursor = seq + 1
        if not batch:
            return
        did = ssn.next_delivery
        ssn.next_delivery = did + len(batch)
        c.delivered += len(batch)
        if q.amqp and c.maps_amqp:
            batch = [*map(qflow_entry, batch)]
        c.write(did, batch, sum(map(len, batch)))
        if untracked:  # keep unacked's index = delivery id - base
            ssn.unacked += [None] * len(batch)
            ssn.unacked_queues += [None] * len(batch)
        self.dirty[ssn] = None

    def _deliver(self, c: Consumer, q: Queue, limit: int) -> None:
        """Deliver from the head of ``q`` to ``c`` while it has credit, at most
        ``limit`` messages (-1: no limit). The per-message path: the batch is
        taken off the queue in C where it can be, and handed to the
        consumer's writer whole."""
        entries = q.entries
        credit = c.credit
        n = len(entries)
        if not n or credit == 0 or limit == 0:
            return
        ssn = c.session
        room = ssn.out.room()
        if room <= 0:
            self.stalled[q] = None
            return
        if 0 < credit < n:
            n = credit
        if 0 < limit < n:
            n = limit
        byte_credit = c.byte_credit
        popleft = entries.popleft
        if byte_credit < 0:
            if n == len(entries):  # the usual case: the consumer keeps up
                batch = list(entries)
                entries.clear()
            else:
                batch = [*starmap(popleft, repeat((), n))]  # n pops, with no Python frame per message
            nbytes = sum(map(len, batch))
            if nbytes > room and n > 1:  # the output takes this much, at least one message: the rest stays
                ends = [*accumulate(map(len, batch))]
                n = bisect_right(ends, room) or 1
                entries.extendleft(reversed(batch[n:]))
                del batch[n:]
                nbytes = ends[n - 1]
                self.stalled[q] = None
        else:
            batch = []
            nbytes = 0
            for _ in range(n):
                e = entries[0]
                size = seq_and_size(e)[1]
                if byte_credit < size:
                    break
                if nbytes >= room:
                    self.stalled[q] = None
                    break
                byte_credit -= size
                nbytes += len(e)
                batch.append(popleft())
            if not batch:
                return
            n = len(batch)
            c.byte_credit = byte_credit
        if credit > 0:
            c.credit = credit - n
        did = ssn.next_delivery
        ssn.next_delivery = did + n
        c.delivered += n
        if q.amqp and c.maps_amqp:  # the consumer gets them mapped; what waits for its accept is as stored
            wire = [*map(qflow_entry, batch)]
            c.write(did, wire, sum(map(len, wire)))
        else:
            c.write(did, batch, nbytes)
        unacked = ssn.unacked
        if c.accept_mode == ACCEPT_EXPLICIT:
            if not unacked:
                ssn.unacked_base = did
            unacked += batch
            ssn.unacked_queues += [q] * n
            ssn.unacked_count += n
        else:
            if unacked:  # keep unacked's index = delivery id - base
                unacked += [None] * n
                ssn.unacked_queues += [None] * n
            q.dequeue_many(batch)
        self.dirty[ssn] = None
