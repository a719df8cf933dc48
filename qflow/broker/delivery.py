"""Delivery: from a queue's head to its consumers, as their credit allows,
and to its browsers. No I/O.

The per-message path: a delivery is the consumer's head (its message.deliver
frame up to the delivery id, qflow.protocol.encodings) and the stored entry,
appended to the session's output as two parts and copied once, when the
encoder joins its parts. A connection that takes message.deliver-run frames
gets many entries per frame. Deliveries that need no accept are dequeued at
once; the others wait in the session's unacked lists for message.accept.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from itertools import accumulate, repeat, starmap

from qflow.broker.queue import Consumer, Queue
from qflow.broker.session import BrokerSession
from qflow.protocol import ACCEPT_EXPLICIT
from qflow.protocol.entries import Entry, seq_and_size, seq_of


class Delivery:
    """Delivers for every queue; ``dirty`` collects the sessions given deliveries."""

    def __init__(self, dirty: dict[BrokerSession, None]) -> None:
        self.dirty = dirty

    def dispatch(self, q: Queue) -> None:
        """Deliver what ``q`` has to its browsers and consumers, as their credit allows."""
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
                if c.credit != 0 and (c.byte_credit < 0 or c.byte_credit >= size):
                    break
            else:
                return
            self._deliver(c, q, 1)

    def _browse(self, c: Consumer, q: Queue) -> None:
        """Deliver copies of the entries from the browser's cursor on, as credit allows."""
        entries = q.entries
        if not entries or seq_of(entries[-1]) < c.cursor or c.credit == 0:
            return
        i = bisect_left(entries, c.cursor, key=seq_of)
        n = len(entries)
        ssn = c.session
        out = ssn.out.parts
        untracked = bool(ssn.unacked)
        runs = c.run_head is not None
        batch: list[Entry] = []
        first_did = ssn.next_delivery
        while i < n and c.credit != 0:
            e = entries[i]
            seq, size = seq_and_size(e)
            if c.byte_credit >= 0:
                if c.byte_credit < size:
                    break
                c.byte_credit -= size
            if c.credit > 0:
                c.credit -= 1
            did = ssn.next_delivery
            ssn.next_delivery = did + 1
            if runs:
                batch.append(e)
            else:
                out.append(c.head(0xCF, did))
                out.append(e)
            if untracked:
                ssn.unacked.append(None)
                ssn.unacked_queues.append(None)
            c.cursor = seq + 1
            i += 1
        if batch:
            self._write_runs(c, first_did, batch)
        self.dirty[ssn] = None

    def _deliver(self, c: Consumer, q: Queue, limit: int) -> None:
        """Deliver from the head of ``q`` to ``c`` while it has credit, at most
        ``limit`` messages (-1: no limit). The per-message path: the frame is
        the consumer's head, the delivery id and the stored entry, copied."""
        if c.run_head is not None:
            self._deliver_runs(c, q, limit)
            return
        entries = q.entries
        credit = c.credit
        if not entries or credit == 0:
            return
        ssn = c.session
        out = ssn.out.parts
        head = c.head
        did = first_did = ssn.next_delivery
        byte_credit = c.byte_credit
        explicit = c.accept_mode == ACCEPT_EXPLICIT
        unacked, unacked_queues = ssn.unacked, ssn.unacked_queues
        if explicit and not unacked:
            ssn.unacked_base = did
        untracked = not explicit and bool(unacked)  # keep unacked's index = delivery id - base
        done: list[Entry] = []  # delivered without accept: dequeued at once
        popleft = entries.popleft
        while entries and credit != 0 and limit != 0:
            e = entries[0]
            if byte_credit >= 0:
                size = seq_and_size(e)[1]
                if byte_credit < size:
                    break
                byte_credit -= size
            popleft()
            out.append(head(0xCF, did))
            out.append(e)
            did += 1
            limit -= 1
            if credit > 0:
                credit -= 1
            if explicit:
                unacked.append(e)
                unacked_queues.append(q)
            else:
                if untracked:
                    unacked.append(None)
                    unacked_queues.append(None)
                done.append(e)
        if done:
            q.dequeue_many(done)
        c.credit = credit
        c.byte_credit = byte_credit
        if did != first_did:
            ssn.next_delivery = did
            if explicit:
                ssn.unacked_count += did - first_did
            self.dirty[ssn] = None

    def _deliver_runs(self, c: Consumer, q: Queue, limit: int) -> None:
        """:meth:`_deliver` to a connection that takes message.deliver-run
        frames: the same deliveries, many entries per frame, and nothing
        done per message but taking it off the queue."""
        entries = q.entries
        credit = c.credit
        n = len(entries)
        if not n or credit == 0 or limit == 0:
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
        else:
            batch = []
            for _ in range(n):
                size = seq_and_size(entries[0])[1]
                if byte_credit < size:
                    break
                byte_credit -= size
                batch.append(popleft())
            if not batch:
                return
            n = len(batch)
            c.byte_credit = byte_credit
        if credit > 0:
            c.credit = credit - n
        ssn = c.session
        did = ssn.next_delivery
        ssn.next_delivery = did + n
        self._write_runs(c, did, batch)
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

    @staticmethod
    def _write_runs(c: Consumer, did: int, batch: list[Entry]) -> None:
        """message.deliver-run frames for ``batch``, delivery ids from ``did`` on,
        as few as the connection's frame size allows. The entries themselves
        go to the encoder: they are copied once, when it joins its parts."""
        out = c.session.out.parts
        run_head, cap = c.run_head, c.run_cap
        size = sum(map(len, batch))
        if size <= cap:
            out.append(run_head(0xCF, did, 0xCE, len(batch), 0xC6, size))
            out += batch
            return
        # A frame takes entries while they fit in cap, and at least one: one
        # bisection per frame, not a Python step per message.
        ends = [*accumulate(map(len, batch))]
        n = len(ends)
        first = base = 0
        while first < n:
            i = bisect_right(ends, base + cap, first)
            if i == first:  # an entry larger than cap goes alone
                i = first + 1
            out.append(run_head(0xCF, did + first, 0xCE, i - first, 0xC6, ends[i - 1] - base))
            out += batch[first:i]
            first, base = i, ends[i - 1]
