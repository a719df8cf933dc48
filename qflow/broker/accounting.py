"""Per-queue flow accounting and transfer completion, batch-shaped.

This module is the single place where the Qpid C++ flow-control rules are
applied. Two implementations share one interface and must behave identically:
``PyAccounting`` (below) and ``NativeAccounting`` (``native/accounting.c``
compiled with cffi). ``load_accounting()`` picks one from ``QFLOW_ACCOUNTING``.

The rules (Qpid C++ broker manual, "Producer Flow Control"):

* "When the total number of enqueued messages is greater than [stop], the
  queue's flow control state transitions to ON" -- either threshold crossed
  (count > stop_count or bytes > stop_size; a zero threshold is not in force).
* "it remains ON until the total number of enqueued messages is less than
  [resume]" -- and with both units, "until both resume thresholds are
  satisfied" (count < resume_count AND bytes < resume_size). A unit takes part
  in resuming when its *resume* threshold is non-zero, as in qpidd's
  ``QueueFlowLimit::dequeued``: qpidd's resolution (``qflow.broker.settings``) can
  leave a unit with stop 0 and a pre-filled resume, and that unit must still
  drain below it. Hence ``set_thresholds`` requires resume <= stop only for a
  unit whose stop is non-zero.
* "The Broker enforces flow control by delaying the completion of the
  Message.Transfer command that causes a message to be delivered to a queue
  with active flow control ... until flow control state transitions to OFF for
  all queues that are a destination for that command."
* A held message dequeued while the flow is still ON is released from that
  queue at once (as the C++ broker's QueueFlowLimit does).

Why batch-shaped: a cffi call costs more than the same few lines of Python,
so the broker never calls per message. It appends fixed-width ops to an
``array('q')`` log while it processes one input batch, then ``apply(log)``
replays the whole log in one call. A transfer is opened with a routing hold,
each enqueue on a stopped queue adds a hold, each OP_HOLD adds an outside
holder's, and closing the transfer drops the routing hold; a transfer whose
holds reach zero is complete. So the accounting, not Python per message,
produces the completed command-id ranges.

Op log: ``OP_WORDS`` int64 words per op, ``(op, a, b, c, d)``:

* ``OP_TRANSFER (session, command_id, 0, 0)``: open a transfer.
* ``OP_ENQUEUE (queue, nbytes, 0, 0)``: enqueue one message on ``queue`` for
  the open transfer (or for no transfer, when none is open: nothing to hold).
* ``OP_END (0, 0, 0, 0)``: close the open transfer (drop its routing hold).
* ``OP_TRANSFER1 (session, command_id, queue, nbytes)``: the common case of
  one destination, equal to TRANSFER + ENQUEUE + END.
* ``OP_DEQUEUE (queue, nbytes, token, 0)``: dequeue one message; ``token`` is
  the hold token reported when it was enqueued, or -1 if it was not held.
* ``OP_DEQUEUE_N (queue, nbytes, count, 0)``: dequeue ``count`` messages of
  ``nbytes`` in all, none of them held: the same as ``count`` OP_DEQUEUEs with
  token -1, except that a resume transition it causes reports the depth after
  all of them (an accept of 500 deliveries is one op, not 500).
* ``OP_HOLD (holder, 0, 0, 0)``: outside holder ``holder`` holds the open
  transfer (only between OP_TRANSFER and its OP_END; anywhere else it is an
  error). No depth changes.
* ``OP_RELEASE (holder, token, 0, 0)``: ``holder`` lets go of its hold
  ``token``; the transfer completes if that was its last holder. A token
  that names no live hold of ``holder`` (released already, dropped with its
  session, released when its holder was removed, or never issued) is ignored,
  as a stale dequeue token is.

``apply`` returns ``(completions, holds, transitions)``:

* completions: ``[(session, first, last), ...]`` ranges of completed command
  ids, consecutive ids coalesced, in the order they completed.
* holds: ``[(op_index, token, session, slot), ...]`` for each held enqueue
  (``slot`` is the queue) and each OP_HOLD (``slot`` is the holder); op_index
  counts ops, not words.
* transitions: ``[(queue, flow_on, count, nbytes), ...]`` each time a queue's
  flow state changed, with the depth at that moment.

A hold token is ``generation << 32 | index`` into the queue's pending list;
releasing the whole list bumps the generation, so stale tokens are ignored.
A session slot is any int chosen by the caller; ``drop_session`` forgets a
closed session's transfers: they leave the pending lists and the outside
holds (the messages stay enqueued, the counts are untouched) and their
completions are never reported.

Outside holders (the durable store: it holds a transfer until its messages
are on disk). ``add_holder`` registers one. A holder has no depth and no
thresholds, so it never stops and never releases by resuming: a hold it is
given by OP_HOLD lasts until OP_RELEASE, ``drop_session`` or
``remove_holder``, which releases every hold it has (completions grouped and
coalesced as when a queue resumes). Queues and holders share one slot
numbering and one free list (last freed, first reused, either kind); an op or
call that wants one kind, given a slot of the other, fails as an unknown slot
of the kind it wanted (``stats`` takes either: a holder's is ``(0, 0, False,
0, held)``). An outside hold's token is ``generation << 32 | index`` into one
table of outside holds that all holders share: a released entry is reused
last released first, with its generation bumped (modulo 2**31), so an old
token never names a later hold, whichever holder now has the entry or the
slot. A holder's memory is what it holds now, not what it ever held: it never
resumes, so a pending list like a queue's would only ever grow.
"""

from __future__ import annotations

import os
from array import array

from qflow.broker.ops import (  # noqa: F401 - the op log's format, re-exported with the accounting
    COUNT_MAX,
    OP_DEQUEUE,
    OP_DEQUEUE_N,
    OP_END,
    OP_ENQUEUE,
    OP_HOLD,
    OP_RELEASE,
    OP_TRANSFER,
    OP_TRANSFER1,
    OP_WORDS,
    SIZE_MAX,
    Accounting,
    AccountingError,
    CompletedRange,
    Hold,
    Transition,
    generation_of,
    make_token,
    next_generation,
    thresholds_ok,
)


class _Queue:
    __slots__ = (
        "count", "nbytes", "stop_count", "resume_count", "stop_size", "resume_size",
        "flow_on", "stopped_count", "pending", "generation", "held",
    )

    def __init__(self) -> None:
        self.count = self.nbytes = 0
        self.stop_count = self.resume_count = self.stop_size = self.resume_size = 0
        self.flow_on = False
        self.stopped_count = self.generation = 0
        self.pending: list[int] = []  # transfer slots, -1 where released
        self.held = 0  # live entries in pending

    def over_stop(self) -> bool:
        return (self.stop_count > 0 and self.count > self.stop_count) or (
            self.stop_size > 0 and self.nbytes > self.stop_size
        )

    def under_resume(self) -> bool:
        # A zero *resume* threshold leaves its unit out (qpidd's dequeued()), not a zero stop.
        return (self.resume_count == 0 or self.count < self.resume_count) and (
            self.resume_size == 0 or self.nbytes < self.resume_size
        )


class _Holder:
    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = 0  # live outside holds it has


class PyAccounting:
    """The pure-Python accounting: the reference the C code must match."""

    name = "python"

    def __init__(self) -> None:
        # One slot numbering for queues and holders: a holder's slot is None here (so every
        # queue op refuses it as an unknown queue, at no cost) and its _Holder is in _holders.
        self._queues: list[_Queue | None] = []
        self._holders: dict[int, _Holder] = {}
        self._free_queues: list[int] = []
        # transfer slot -> [holds, session, command_id]; session None once
        # dropped (not -1: a session may be any int, negative ones included)
        self._transfers: list[list[int | None] | None] = []
        self._free_transfers: list[int] = []
        # The outside holds, all holders': [transfer slot (-1 while free), holder, generation].
        self._outside: list[list[int]] = []
        self._free_outside: list[int] = []

    # -- queues -------------------------------------------------------------
    def _take_slot(self, queue: _Queue | None) -> int:
        if self._free_queues:
            slot = self._free_queues.pop()
            self._queues[slot] = queue
        else:
            slot = len(self._queues)
            self._queues.append(queue)
        return slot

    def add_queue(self) -> int:
        return self._take_slot(_Queue())

    def _queue(self, queue: int) -> _Queue:
        if queue < 0 or queue >= len(self._queues) or self._queues[queue] is None:
            raise AccountingError(f"unknown queue slot {queue}")
        return self._queues[queue]  # type: ignore[return-value]

    def _op_queue(self, index: int, queue: int) -> _Queue:
        # As _queue, but the error names the op, like every other op log error.
        if queue < 0 or queue >= len(self._queues) or self._queues[queue] is None:
            raise AccountingError(f"op {index}: unknown queue slot {queue}")
        return self._queues[queue]  # type: ignore[return-value]

    def remove_queue(self, queue: int) -> list[CompletedRange]:
        q = self._queue(queue)
        out: list[CompletedRange] = []
        self._release_all(q, out)
        self._queues[queue] = None
        self._free_queues.append(queue)
        return out

    # -- outside holders ----------------------------------------------------
    def add_holder(self) -> int:
        slot = self._take_slot(None)
        self._holders[slot] = _Holder()
        return slot

    def _op_holder(self, index: int, holder: int) -> _Holder:
        h = self._holders.get(holder)
        if h is None:
            raise AccountingError(f"op {index}: unknown holder slot {holder}")
        return h

    def remove_holder(self, holder: int) -> list[CompletedRange]:
        if self._holders.pop(holder, None) is None:
            raise AccountingError(f"unknown holder slot {holder}")
        out: list[CompletedRange] = []
        for i, entry in enumerate(self._outside):
            if entry[0] >= 0 and entry[1] == holder:
                self._unhold(self._free_hold(i), out)
        _group_by_session(out, 0)
        self._free_queues.append(holder)
        return out

    def holds_of(self, holder: int) -> list[tuple[int, int]]:
        """(token, session) of each live hold of outside holder ``holder``, in
        token index order: what a holder that starts naming the sessions it
        holds must know (Completion.name_holds), asked then rather than kept."""
        if holder not in self._holders:
            raise AccountingError(f"unknown holder slot {holder}")
        transfers = self._transfers
        return [(make_token(generation, i), transfers[slot][1]) for i, (slot, h, generation) in enumerate(self._outside)
                if slot >= 0 and h == holder and transfers[slot][1] is not None]

    def _free_hold(self, i: int) -> int:
        """Free outside hold ``i``; returns the transfer it held."""
        entry = self._outside[i]
        slot = entry[0]
        entry[0] = -1
        entry[2] = next_generation(entry[2])
        self._free_outside.append(i)
        return slot

    def set_thresholds(
        self, queue: int, stop_count: int, resume_count: int, stop_size: int, resume_size: int
    ) -> tuple[list[CompletedRange], list[Transition]]:
        q = self._queue(queue)
        if not thresholds_ok(stop_count, resume_count, COUNT_MAX):
            raise AccountingError(f"bad count thresholds {stop_count}/{resume_count}")
        if not thresholds_ok(stop_size, resume_size, SIZE_MAX):
            raise AccountingError(f"bad size thresholds {stop_size}/{resume_size}")
        q.stop_count, q.resume_count = stop_count, resume_count
        q.stop_size, q.resume_size = stop_size, resume_size
        completions: list[CompletedRange] = []
        transitions: list[Transition] = []
        if not q.flow_on and q.over_stop():
            q.flow_on = True
            q.stopped_count = (q.stopped_count + 1) & COUNT_MAX
            transitions.append((queue, True, q.count, q.nbytes))
        elif q.flow_on and q.under_resume():
            q.flow_on = False
            transitions.append((queue, False, q.count, q.nbytes))
            self._release_all(q, completions)
        return completions, transitions

    def stats(self, queue: int) -> tuple[int, int, bool, int, int]:
        """(count, bytes, flow_on, stopped_count, held); a holder's is (0, 0, False, 0, held)."""
        h = self._holders.get(queue)
        if h is not None:
            return 0, 0, False, 0, h.held
        q = self._queue(queue)
        return q.count, q.nbytes, q.flow_on, q.stopped_count, q.held

    # -- transfers ----------------------------------------------------------
    def _new_transfer(self, session: int, command_id: int) -> int:
        if self._free_transfers:
            slot = self._free_transfers.pop()
            self._transfers[slot] = [1, session, command_id]
        else:
            slot = len(self._transfers)
            self._transfers.append([1, session, command_id])
        return slot

    def _unhold(self, slot: int, out: list[CompletedRange]) -> None:
        t = self._transfers[slot]
        assert t is not None
        t[0] -= 1  # type: ignore[operator]
        if t[0] == 0:
            if t[1] is not None:
                _add_completion(out, t[1], t[2])  # type: ignore[arg-type]
            self._transfers[slot] = None
            self._free_transfers.append(slot)

    def _release_all(self, q: _Queue, out: list[CompletedRange]) -> None:
        """Release every held transfer. Its completions are ordered by
        (session, first id) and coalesced: a release interleaves sessions."""
        pending = q.pending
        q.pending = []
        q.generation = next_generation(q.generation)
        q.held = 0
        done: list[CompletedRange] = []  # (session, id, id) of each transfer this completes, then sorted once
        for slot in pending:
            if slot >= 0:
                self._unhold(slot, done)
        if len(done) > 1:
            done.sort()
        for session, first, last in done:
            _add_range(out, session, first, last)

    def drop_session(self, session: int) -> None:
        for q in self._queues:
            if q is None:
                continue
            pending = q.pending
            for i, slot in enumerate(pending):
                if slot >= 0 and self._transfers[slot][1] == session:  # type: ignore[index]
                    pending[i] = -1
                    q.held -= 1
                    self._unhold(slot, [])
        for i, entry in enumerate(self._outside):
            if entry[0] >= 0 and self._transfers[entry[0]][1] == session:  # type: ignore[index]
                self._holders[entry[1]].held -= 1
                self._unhold(self._free_hold(i), [])
        for t in self._transfers:
            if t is not None and t[1] == session:
                t[1] = None

    # -- the batch ----------------------------------------------------------
    def apply(self, log: array) -> tuple[list[CompletedRange], list[Hold], list[Transition]]:
        completions: list[CompletedRange] = []
        holds: list[Hold] = []
        transitions: list[Transition] = []
        nwords = len(log)
        if nwords % OP_WORDS:
            raise AccountingError(f"op log of {nwords} words is not a multiple of {OP_WORDS}")
        current = -1  # slot of the open transfer, -1 if none
        session = command_id = 0
        opened = False
        for index in range(nwords // OP_WORDS):
            base = index * OP_WORDS
            op = log[base]
            a = log[base + 1]
            b = log[base + 2]
            if op == OP_TRANSFER or op == OP_TRANSFER1:
                if opened:
                    raise AccountingError(f"op {index}: transfer opened inside a transfer")
                opened, current, session, command_id = True, -1, a, b
                if op == OP_TRANSFER:
                    continue
                a = log[base + 3]
                b = log[base + 4]
            if op == OP_ENQUEUE or op == OP_TRANSFER1:
                q = self._op_queue(index, a)
                if b < 0 or q.nbytes + b > SIZE_MAX or q.count >= COUNT_MAX:
                    raise AccountingError(f"op {index}: enqueue overflows queue {a}")
                q.count += 1
                q.nbytes += b
                if not q.flow_on and q.over_stop():
                    q.flow_on = True
                    q.stopped_count = (q.stopped_count + 1) & COUNT_MAX
                    transitions.append((a, True, q.count, q.nbytes))
                if q.flow_on and opened:
                    if current < 0:
                        current = self._new_transfer(session, command_id)
                    self._transfers[current][0] += 1  # type: ignore[index]
                    token = make_token(q.generation, len(q.pending))
                    q.pending.append(current)
                    q.held += 1
                    holds.append((index, token, session, a))
                if op == OP_ENQUEUE:
                    continue
            if op == OP_END or op == OP_TRANSFER1:
                if not opened:
                    raise AccountingError(f"op {index}: end without a transfer")
                opened = False
                if current < 0:
                    _add_completion(completions, session, command_id)
                else:
                    self._unhold(current, completions)
            elif op == OP_DEQUEUE:
                q = self._op_queue(index, a)
                if q.count == 0 or b < 0 or b > q.nbytes:
                    raise AccountingError(f"op {index}: dequeue underflows queue {a}")
                q.count -= 1
                q.nbytes -= b
                if q.flow_on and q.under_resume():
                    q.flow_on = False
                    transitions.append((a, False, q.count, q.nbytes))
                    self._release_all(q, completions)
                else:
                    token = log[base + 3]
                    if token >= 0 and generation_of(token) == q.generation:
                        i = token & 0xFFFFFFFF
                        if i < len(q.pending) and q.pending[i] >= 0:
                            slot = q.pending[i]
                            q.pending[i] = -1
                            q.held -= 1
                            self._unhold(slot, completions)
            elif op == OP_DEQUEUE_N:
                q = self._op_queue(index, a)
                n = log[base + 3]
                if n < 0 or n > q.count or b < 0 or b > q.nbytes:
                    raise AccountingError(f"op {index}: dequeue underflows queue {a}")
                q.count -= n
                q.nbytes -= b
                if q.flow_on and q.under_resume():
                    q.flow_on = False
                    transitions.append((a, False, q.count, q.nbytes))
                    self._release_all(q, completions)
            elif op == OP_HOLD:
                if not opened:
                    raise AccountingError(f"op {index}: hold outside a transfer")
                h = self._op_holder(index, a)
                if current < 0:
                    current = self._new_transfer(session, command_id)
                self._transfers[current][0] += 1  # type: ignore[index]
                if self._free_outside:
                    i = self._free_outside.pop()
                    entry = self._outside[i]
                    entry[0], entry[1] = current, a
                else:
                    i = len(self._outside)
                    entry = [current, a, 0]
                    self._outside.append(entry)
                h.held += 1
                holds.append((index, make_token(entry[2], i), session, a))
            elif op == OP_RELEASE:
                h = self._op_holder(index, a)
                i = b & 0xFFFFFFFF
                if b >= 0 and i < len(self._outside):
                    entry = self._outside[i]
                    if entry[0] >= 0 and entry[1] == a and entry[2] == generation_of(b):
                        h.held -= 1
                        self._unhold(self._free_hold(i), completions)
            elif op != OP_TRANSFER1:
                raise AccountingError(f"op {index}: unknown op code {op}")
        if opened:
            raise AccountingError("op log ends inside a transfer")
        return completions, holds, transitions


def _add_range(out: list[CompletedRange], session: int, first: int, last: int) -> None:
    if out:
        s, f, prev_last = out[-1]
        if s == session and prev_last + 1 == first:
            out[-1] = (s, f, last)
            return
    out.append((session, first, last))


def _add_completion(out: list[CompletedRange], session: int, command_id: int) -> None:
    # _add_range for one id, written out: a release of 10,000 holds calls it 10,000 times.
    last = out[-1] if out else None
    if last is not None and last[0] == session and last[2] + 1 == command_id:
        out[-1] = (session, last[1], command_id)
    else:
        out.append((session, command_id, command_id))


def _group_by_session(out: list[CompletedRange], start: int) -> None:
    """A release of many holds interleaves sessions: order its completions (from
    ``start`` on) by (session, first id) and coalesce them."""
    if len(out) - start > 1:
        released = sorted(out[start:])
        del out[start:]
        for session, first, last in released:
            _add_range(out, session, first, last)


def native_available() -> bool:
    try:
        from qflow import _accounting_native  # noqa: F401
    except ImportError:
        return False
    return True


def load_accounting(kind: str | None = None) -> Accounting:
    """Return the accounting named by ``kind`` or ``$QFLOW_ACCOUNTING``:
    ``native`` (the default when the C extension is built) or ``python``."""
    kind = kind or os.environ.get("QFLOW_ACCOUNTING") or ("native" if native_available() else "python")
    if kind == "python":
        return PyAccounting()
    if kind == "native":
        from qflow.broker._native_accounting import NativeAccounting

        return NativeAccounting()
    raise ValueError(f"QFLOW_ACCOUNTING must be 'native' or 'python', not {kind!r}")
