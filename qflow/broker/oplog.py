"""The op log: what queues, transfers and holders announce between two
applies, in the accounting's format (qflow.broker.ops). No I/O.

Every op a batch produces is written here and nowhere else: a transfer opens
(OP_TRANSFER) and closes (OP_END) its entry, each of its queues enqueues into
it (OP_ENQUEUE, or OP_TRANSFER1 for a transfer with one destination), each
outside holder of those queues holds it (OP_HOLD); a queue announces its
dequeues (OP_DEQUEUE, OP_DEQUEUE_N); a holder lets go (OP_RELEASE). The
transfer scanner (native/transfers.c) writes a run's ops in C and hands them
over whole (:meth:`OpLog.add_run`, :meth:`OpLog.add_fanout_run`).

Beside each op the log keeps one Python value (``seqs``): the sequence number
an OP_ENQUEUE or OP_TRANSFER1 gave its message, for an OP_HOLD the messages
held (``(queue, entry)`` pairs), else None. The completion (qflow.broker.completion)
takes the log once per batch, runs it through the accounting in one call, and
reads the values of the ops the accounting reports on.

A dequeue names the hold it releases, if the queue holds that message's
transfer: the queue's holds (``held``, kept by the completion) are asked
here, so a queue never reads flow state itself.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import qflow.broker.ops as ops
from qflow.broker.ops import OP_WORDS, pack_op
from qflow.protocol.entries import Entry, seq_and_size

# (first op index, op count, queue) of a run whose OP_HOLDs carry bare entries of that queue
# (add_fanout_run, one durable queue): the completion makes them (queue, entry) pairs only if it must.
LoggedRun = tuple[int, int, Any]


class HeldTokens(Protocol):
    """A queue's holds as the op log asks them (qflow.broker.completion.QueueHolds)."""

    tokens: dict[int, Any]

    def release_token(self, seq: int) -> int: ...


class OpLog:
    """The ops announced since the last apply, and their values.

    ``ops`` is the packed log, ``seqs`` its values (one per op), ``runs``
    the logged runs whose OP_HOLDs carry bare entries. ``held`` maps a queue's
    accounting slot to its holds (set by the completion for every queue)."""

    __slots__ = ("ops", "seqs", "runs", "held")

    def __init__(self) -> None:
        self.ops = bytearray()
        self.seqs: list[Any] = []
        self.runs: list[LoggedRun] = []
        self.held: dict[int, HeldTokens] = {}

    def __bool__(self) -> bool:
        return bool(self.ops)

    def take(self) -> tuple[memoryview, list[Any], list[LoggedRun]]:
        """The log so far (ops as int64 words, values, runs), leaving it empty."""
        ops, seqs, runs = memoryview(self.ops).cast("q"), self.seqs, self.runs
        self.ops = bytearray()
        self.seqs = []
        if runs:
            self.runs = []
        return ops, seqs, runs

    # -- a transfer ---------------------------------------------------------------
    def transfer1(self, session: int, command_id: int, queue: int, size: int, seq: int) -> None:
        """The whole transfer ``command_id`` of ``session``, to one queue: its message ``seq`` of ``size`` bytes."""
        self.seqs.append(seq)
        self.ops += pack_op(ops.OP_TRANSFER1, session, command_id, queue, size)

    def open_transfer(self, session: int, command_id: int) -> None:
        """Transfer ``command_id`` of ``session`` begins: its enqueues and holds follow, then :meth:`close_transfer`."""
        self.seqs.append(None)
        self.ops += pack_op(ops.OP_TRANSFER, session, command_id, 0, 0)

    def enqueue(self, queue: int, size: int, seq: int) -> None:
        """Message ``seq`` of ``size`` bytes enqueued on ``queue``: in the open transfer, or outside any
        (a message recovered by the store)."""
        self.seqs.append(seq)
        self.ops += pack_op(ops.OP_ENQUEUE, queue, size, 0, 0)

    def hold(self, holder: int, messages: tuple[tuple[Any, Entry], ...]) -> None:
        """In the open transfer, after its enqueues: outside holder ``holder`` holds it, for
        ``messages`` (the ``(queue, entry)`` of each of its queues that carries the holder)."""
        self.seqs.append(messages)
        self.ops += pack_op(ops.OP_HOLD, holder, 0, 0, 0)

    def close_transfer(self) -> None:
        """The open transfer is routed: its routing hold is let go."""
        self.seqs.append(None)
        self.ops += pack_op(ops.OP_END, 0, 0, 0, 0)

    def add_run(self, ops: Any, first_seq: int, count: int) -> None:
        """A run of ``count`` transfers to one queue, written by the transfer scanner (``ops``:
        one OP_TRANSFER1 each), numbered from ``first_seq``."""
        self.seqs.extend(range(first_seq, first_seq + count))
        self.ops += ops

    def add_fanout_run(self, ops: Any, queues: Sequence[Any], first_seqs: Sequence[int],
                       entries: Sequence[Sequence[Entry]], covered: Sequence[Sequence[int]]) -> None:
        """A run of transfers to several queues, or to queues with outside holders, whose ops the
        transfer scanner wrote: per transfer OP_TRANSFER, an OP_ENQUEUE per queue, an OP_HOLD per
        holder, OP_END. ``first_seqs[j]`` and ``entries[j]`` are queue j's numbers and entries;
        ``covered[h]`` the indices of the queues that carry holder h."""
        seqs = self.seqs
        n = len(entries[0])
        if not covered:
            for i in range(n):
                seqs.append(None)
                seqs += [s + i for s in first_seqs]
                seqs.append(None)
        elif len(queues) == 1 and len(covered) == 1:  # one durable queue: the store's usual input
            # Per transfer (None, seq, entry, None), filled in by column: no Python call, and no tuple,
            # per message; ``runs`` says whose entries they are.
            block: list[Any] = [None] * (4 * n)
            block[1::4] = range(first_seqs[0], first_seqs[0] + n)
            block[2::4] = entries[0]
            self.runs.append((len(seqs), len(block), queues[0]))
            seqs += block
        else:
            for i in range(n):
                seqs.append(None)
                seqs += [s + i for s in first_seqs]
                seqs += [tuple((queues[j], entries[j][i]) for j in held) for held in covered]
                seqs.append(None)
        self.ops += ops

    # -- dequeues -------------------------------------------------------------------
    def dequeue(self, queue: int, entry: Entry) -> None:
        """``entry`` left ``queue`` for good; the hold the queue has on its transfer, if any, goes with it."""
        seq, size = seq_and_size(entry)
        self.seqs.append(None)
        self.ops += pack_op(ops.OP_DEQUEUE, queue, size, self.held[queue].release_token(seq), 0)

    def dequeue_many(self, queue: int, entries: Sequence[Entry], nbytes: int) -> None:
        """``entries`` (``nbytes`` in all) left ``queue`` for good: those whose transfer the queue
        holds one by one (their holds released), the rest as one OP_DEQUEUE_N."""
        held = self.held[queue]
        n = len(entries)
        if held.tokens:
            tokens = held.tokens
            for entry in entries:
                seq, size = seq_and_size(entry)
                if seq in tokens:
                    self.seqs.append(None)
                    self.ops += pack_op(ops.OP_DEQUEUE, queue, size, held.release_token(seq), 0)
                    n -= 1
                    nbytes -= size
        if n:
            self.seqs.append(None)
            self.ops += pack_op(ops.OP_DEQUEUE_N, queue, nbytes, n, 0)

    # -- outside holders ------------------------------------------------------------
    def release(self, holder: int, tokens: array) -> None:
        """Outside holder ``holder`` lets go of ``tokens`` (an int64 column): one OP_RELEASE each."""
        # Built column by column: no Python call per token (the store releases a whole commit at once).
        n = len(tokens)
        releases = array("q", bytes(8 * OP_WORDS * n))
        releases[0::OP_WORDS] = array("q", (ops.OP_RELEASE,)) * n
        releases[1::OP_WORDS] = array("q", (holder,)) * n
        releases[2::OP_WORDS] = tokens
        self.ops += releases
        self.seqs += [None] * n

    def released_by(self, holder: int) -> set[int]:
        """The tokens ``holder`` has let go of in this log."""
        words = memoryview(self.ops).cast("q")
        return {words[i + 2] for i in range(0, len(words), OP_WORDS)
                if words[i] == ops.OP_RELEASE and words[i + 1] == holder}

    def op_codes(self) -> list[int]:
        """The op code of each op logged so far (tests and diagnostics)."""
        return list(memoryview(self.ops).cast("q")[0::OP_WORDS])
