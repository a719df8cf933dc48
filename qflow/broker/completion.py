"""The completion of a transfer: who holds it back, and when it is done. No I/O.

A producer's transfer is *complete* when every holder of it has let go; only
then does its sender's capacity free up. This is qpidd's AsyncCompletion,
whose use model is, per transfer:

1. *begin*: the transfer opens (OP_TRANSFER) with one hold of its own, its
   routing: it cannot complete before every destination has its message.
2. *one hold per holder*: each destination queue whose flow control is ON
   when the message arrives holds it ("The Broker enforces flow control by
   delaying the completion of the Message.Transfer command that causes a
   message to be delivered to a queue with active flow control ... until flow
   control state transitions to OFF for all queues that are a destination for
   that command"); so does each outside holder its queues carry, once
   (a :class:`Holder`: the durable store until the message is synced, the
   memory alarm while it is set, the store's disk quota while it is overfull).
3. *release*: a holder lets go. A stopped queue lets go of all its holds when
   its flow turns OFF, and of one when that message is dequeued while the
   flow stays ON ("even if flow controlled, we must release"); an outside
   holder lets go of the tokens it chooses (:meth:`Holder.release`).
4. *end*: the routing hold goes when the transfer is routed (OP_END); the
   transfer completes when no hold is left, and its command id joins its
   session's completed ranges.

The counting is the accounting's (qflow.broker.accounting, and its C twin),
fed once per batch with the whole op log (qflow.broker.oplog). What the
accounting decides comes back here: the holds it made (each remembered by its
queue's :class:`QueueHolds`, so the dequeue of that message can release it,
or handed to its outside holder), the flow transitions, and the completed
ranges (returned to the broker, which reports them).

Whoever holds a session's transfer tells it so: a session is *held by* a
queue (or by a named outside holder) while that holds at least one of its
transfers. :class:`Completion` decides when a session becomes held or is held
no more, in the order it happens, and says so through ``tell``; the broker
tells the session (``session.flow-notice``, ``heldBy`` in the views). All of
it is work per *held* message only: a queue holding nothing has no tokens,
and its dequeues take none of these steps.
"""

from __future__ import annotations

import logging
import struct
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any

import qflow.broker.ops as ops
from qflow.broker.oplog import LoggedRun, OpLog
from qflow.broker.ops import OP_RELEASE, generation_of, next_generation, pack_op
from qflow.broker.queue import Queue
from qflow.broker.settings import QueueSettings, describe_transition
from qflow.protocol.entries import Entry
from qflow.protocol.names import printable

log = logging.getLogger("qflow.broker")

_op_index_of, _token_of, _slot_of = itemgetter(0), itemgetter(1), itemgetter(3)  # of a Hold
_run_ops = itemgetter(1)  # of a LoggedRun

# What a holder is handed for each transfer it holds: (its token, the messages held: (queue, entry) for
# each of the transfer's queues that carry the holder).
Held = tuple[int, tuple[tuple[Queue, Entry], ...]]
# A run of holds of one queue's transfers, a message each (Holder.take_runs): (queue, tokens, entries,
# their sequence numbers: a range). They come from one run of transfer frames (native/transfers.h), so
# the entries have the same exchange, routing key and properties, but for a message id.
HeldRun = tuple[Queue, list[int], list[Entry], range]
# What a holder may be told of dequeues: (queue, the entries dequeued from it).
Dequeued = Callable[[Queue, Sequence[Entry]], None]
# What the completion decided for a session: tell(session, name, held, outside holder?).
Tell = Callable[[Any, str, bool, bool], None]


def _nothing() -> None:
    pass


def _held_messages(seqs: list[Any], runs: list[LoggedRun]) -> list[Any]:
    """``seqs`` (an applied log's, no longer shared) with each bare entry of
    ``runs`` made the ``((queue, entry),)`` every other OP_HOLD carries."""
    for start, nops, q in runs:
        holds = range(start + 2, start + nops, 4)  # per transfer: TRANSFER, ENQUEUE, HOLD, END
        seqs[start + 2:start + nops:4] = [((q, seqs[i]),) for i in holds]
    return seqs


class QueueHolds:
    """The transfers one queue's flow control holds, by message sequence
    number, and the sessions they belong to. Its thresholds and ON/OFF state
    live in the accounting, under ``slot``."""

    __slots__ = ("slot", "tokens", "held_sessions", "generation", "unheld")

    def __init__(self, slot: int, unheld: list[tuple[QueueHolds, Any]]) -> None:
        self.slot = slot
        # seq -> (the accounting's hold token, the session whose transfer it holds), for
        # messages whose transfer is held here; emptied when the queue lets all go.
        self.tokens: dict[int, tuple[int, Any]] = {}
        # Session -> how many of its transfers are held here, in the order they were first
        # held: a dict, not a set, so the release notices go out in that order (a set's order
        # follows object addresses, and differed from run to run).
        self.held_sessions: dict[Any, int] = {}
        # The accounting's generation of this queue's holds (qflow.broker.ops.generation_of): it
        # moves on each time the queue lets all go (Completion.released), as in the accounting.
        self.generation = 0
        self.unheld = unheld  # Completion.unheld, where a session no longer held here waits to be told

    def release_token(self, seq: int) -> int:
        """The hold token of message ``seq`` if its transfer is held here
        (forgotten now: the message is being dequeued, and the accounting lets
        it go with this token), else -1. A session whose last transfer held
        here this was is queued to be told (Completion.apply)."""
        if not self.tokens:  # the usual case: nothing held here
            return -1
        held = self.tokens.pop(seq, None)
        if held is None:
            return -1
        token, ssn = held
        if generation_of(token) != self.generation:  # let go already, with all the queue held
            return -1
        n = self.held_sessions.get(ssn)
        if n is not None:  # None: the session was dropped since
            if n > 1:
                self.held_sessions[ssn] = n - 1
            else:
                del self.held_sessions[ssn]
                self.unheld.append((self, ssn))
        return token


class Holder:
    """An outside holder of transfers' completion: the durable store
    (qflow.store.message_store) holds a persistent message's transfer until
    its write is synced; the memory alarm and the store's quota hold every
    transfer of their queues while they are on.

    Queues carry it (:meth:`Queue.add_holder`). A transfer routed to any of them
    is held by it once, however many of its queues carry it: the store writes a
    transfer's messages together and one sync covers them, so one release
    should complete the transfer. After each apply, its new holds wait in
    :meth:`take` and ``wake`` is called; :meth:`release` lets go of them, and
    the transfer completes once its other holders (routing, stopped queues,
    other outside holders) have let go too. Made by :meth:`Completion.add_holder`."""

    __slots__ = ("slot", "name", "completion", "arrived", "runs", "wake", "dequeued", "deleted", "removed", "label",
                 "held_sessions", "token_sessions", "tracks")

    def __init__(self, slot: int, name: str, completion: Completion, wake: Callable[[], None] | None,
                 dequeued: Dequeued | None = None) -> None:
        self.slot = slot  # the accounting's number for it (queues and holders share the numbering)
        self.name = name
        self.completion = completion
        self.arrived: list[Held] = []  # holds given since the last take()
        # Uniform runs of holds given since the last take_runs(). Every one of them came before every
        # hold in ``arrived`` (Completion._runs_only keeps it so), so take() keeps arrival order.
        self.runs: list[HeldRun] = []
        self.wake = wake or _nothing  # called after an apply that gave it holds
        # Told of every message dequeued from a queue that carries it, as it happens (the store
        # writes the removal); queues without holders pay nothing for it.
        self.dequeued = dequeued
        self.deleted: Callable[[Queue], None] | None = None  # told of a deletion of a queue that carries it
        self.removed = False
        # While not None, the sessions it holds are told so under this name (session.flow-notice,
        # heldBy), as a stopped queue's are: see Completion.name_holds.
        self.label: str | None = None
        # Whether naming it also names the sessions of the holds it has already (asked of the
        # accounting then: Completion.name_holds). Either way an unnamed hold costs nothing more.
        self.tracks = False
        self.held_sessions: dict[Any, int] = {}  # session -> its transfers held, while named
        self.token_sessions: dict[int, Any] = {}  # hold token -> its session, while named

    def __repr__(self) -> str:
        return f"<Holder {self.name!r} slot {self.slot}{' removed' if self.removed else ''}>"

    def take(self) -> list[Held]:
        """The holds given to this holder since the last call.

        Returns:
          ``(token, messages)`` per transfer, ``messages`` the ``(queue, entry)``
          it holds (entries as qflow.protocol.entries stores them); those
          :meth:`take_runs` has not taken come first, made pairs.
        """
        arrived, self.arrived = self.arrived, []
        if self.runs:
            runs, self.runs = self.runs, []
            arrived[:0] = [(token, ((q, entry),)) for q, tokens, entries, _ in runs
                           for token, entry in zip(tokens, entries, strict=True)]
        return arrived

    def take_runs(self) -> list[HeldRun]:
        """What :meth:`take` would return first, as uniform runs, the usual
        input of a durable queue: ``(queue, tokens, entries, seqs)`` (see
        ``HeldRun``), one message per transfer, each transfer's token with its
        entry on ``queue`` and its sequence number (no tuple per transfer).
        :meth:`take` then returns the rest."""
        runs, self.runs = self.runs, []
        return runs

    def release(self, tokens: Iterable[int]) -> None:
        """Let go of these holds. They take effect at the broker's next apply
        (:meth:`Broker.release_holds` applies them at once), which completes
        each transfer left without a holder.

        A token of a hold that is gone (released already, its session closed)
        is ignored; after the holder is removed this does nothing: removing it
        released every hold.

        Args:
          tokens: hold tokens from :meth:`take` or :meth:`take_runs`.

        Raises:
          ValueError: a token is not an int64 (nothing is released then).
        """
        if self.removed:
            return
        completion = self.completion
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        if self.token_sessions:
            completion.let_go(self, tokens)
        try:
            column = array("q", tokens)
        except (TypeError, OverflowError):
            for token in tokens:  # name the bad one (nothing was logged)
                try:
                    pack_op(OP_RELEASE, self.slot, token, 0, 0)
                except struct.error:
                    raise ValueError(f"holder {self.name!r}: {token!r} is not a hold token") from None
            raise ValueError(f"holder {self.name!r}: a token given is not a hold token") from None
        completion.oplog.release(self.slot, column)


class Completion:
    """Every transfer's completion, decided once per batch.

    Queues, transfers and holders write their ops into ``oplog``;
    :meth:`apply` runs them through the accounting and returns the completed
    command ranges. What it decides for a session (held by a queue or a named
    holder, or no longer) goes to ``tell(session, name, held, holder)`` in
    the order it happens; ``holder`` says whether ``name`` is an outside
    holder's (else a queue's)."""

    def __init__(self, accounting: ops.Accounting, oplog: OpLog, tell: Tell) -> None:
        self.acct = accounting
        self.oplog = oplog
        self.tell = tell
        self.queues: dict[int, Queue] = {}  # by accounting slot
        self.holds: dict[int, QueueHolds] = {}  # each queue's, by its accounting slot
        self.holders: dict[int, Holder] = {}  # by accounting slot
        self.sessions: dict[int, Any] = {}  # by accounting slot
        # (queue holds, session) whose last transfer held by that queue was let go by a
        # dequeue since the last apply (QueueHolds.release_token): told at the next apply.
        self.unheld: list[tuple[QueueHolds, Any]] = []

    # -- queues ---------------------------------------------------------------
    def add_queue(self, settings: QueueSettings) -> int:
        """A new queue's accounting slot, with ``settings``' thresholds in force; :meth:`attach` the queue next."""
        slot = self.acct.add_queue()
        self.acct.set_thresholds(slot, settings.stop_count, settings.resume_count, settings.stop_size,
                                 settings.resume_size)
        self.holds[slot] = self.oplog.held[slot] = QueueHolds(slot, self.unheld)  # type: ignore[assignment]
        return slot

    def attach(self, q: Queue) -> None:
        """``q`` is the queue of its slot from now on."""
        self.queues[q.slot] = q

    def remove_queue(self, q: Queue) -> list[ops.CompletedRange]:
        """The queue is gone: its held transfers are no longer held by it."""
        completions = self.apply()
        del self.queues[q.slot]
        self.released(q)
        del self.holds[q.slot]
        del self.oplog.held[q.slot]
        return completions + self.acct.remove_queue(q.slot)

    def set_thresholds(self, q: Queue, settings: QueueSettings) -> list[ops.CompletedRange]:
        """New thresholds for a live queue: its flow state is re-evaluated now."""
        completions = self.apply()
        more, transitions = self.acct.set_thresholds(
            q.slot, settings.stop_count, settings.resume_count, settings.stop_size, settings.resume_size)
        self._transitions(transitions, settings)
        return completions + more

    def stats(self, q: Queue) -> tuple[int, int, bool, int, int]:
        """(count, bytes, flow on, times stopped, transfers held) as the accounting has them."""
        return self.acct.stats(q.slot)

    def held_sessions(self, q: Queue) -> dict[Any, int]:
        """The sessions ``q`` holds now, each with how many of its transfers."""
        return self.holds[q.slot].held_sessions

    def held_tokens(self, q: Queue) -> dict[int, tuple[int, Any]]:
        """``q``'s holds now: message sequence number -> (hold token, session)."""
        return self.holds[q.slot].tokens

    # -- outside holders -------------------------------------------------------
    def add_holder(self, name: str, wake: Callable[[], None] | None = None,
                   dequeued: Dequeued | None = None) -> Holder:
        """A new outside holder; it holds nothing until a queue carries it."""
        holder = Holder(self.acct.add_holder(), name, self, wake, dequeued)
        self.holders[holder.slot] = holder
        return holder

    def remove_holder(self, holder: Holder) -> list[ops.CompletedRange]:
        """The holder is gone: no queue carries it any more, and every transfer it
        holds is held by it no more. The log is applied first (its holds and
        releases take effect); returns the completed command ranges."""
        if holder.removed:
            raise ValueError(f"holder {holder.name!r} was removed already")
        completions = self.apply()
        self.name_holds(holder, None)
        for q in self.queues.values():
            if holder in q.holders:
                q.remove_holder(holder)
        del self.holders[holder.slot]
        holder.removed = True
        holder.arrived = []  # released below: nothing left for it to do
        holder.runs = []
        return completions + self.acct.remove_holder(holder.slot)

    def name_holds(self, holder: Holder, label: str | None) -> None:
        """From now on the sessions ``holder`` holds are told so under
        ``label`` (the memory alarm, the store's quota), those it holds already
        included (if it tracks them); None: no longer, and those it holds now
        are told it holds them no more."""
        if label is None:
            for ssn in holder.held_sessions:
                self.tell(ssn, holder.label, False, True)
            holder.held_sessions.clear()
            holder.token_sessions.clear()
            holder.label = None
            return
        if holder.label is not None:
            return
        holder.label = label
        held = holder.held_sessions
        if holder.tracks:  # the holds applied so far, less those let go since (their releases still in the log)
            released = self.oplog.released_by(holder.slot)
            sessions = self.sessions
            holder.token_sessions = {token: sessions.get(slot) for token, slot in self.acct.holds_of(holder.slot)
                                     if token not in released}
        for ssn in holder.token_sessions.values():
            if ssn is not None:
                held[ssn] = held.get(ssn, 0) + 1
        for ssn in held:
            self.tell(ssn, label, True, True)

    def let_go(self, holder: Holder, tokens: Iterable[int]) -> None:
        """A named holder releases ``tokens``: a session none of whose transfers it holds any more is told."""
        held, by_token = holder.held_sessions, holder.token_sessions
        if not held:  # no session to tell (the usual: not named): forget the tokens with no Python call each
            deque(map(by_token.pop, tokens, repeat(None)), maxlen=0)
            return
        for token in tokens:
            ssn = by_token.pop(token, None)
            n = held.get(ssn) if held and ssn is not None else None
            if n is None:
                continue
            if n > 1:
                held[ssn] = n - 1
            else:
                del held[ssn]
                self.tell(ssn, holder.label, False, True)

    def hold(self, queues: Sequence[Queue]) -> None:
        """In an open transfer, after its enqueues on ``queues``: one OP_HOLD per
        outside holder that any of them carry, in the order first carried."""
        for holder, covered in holders_of(queues).items():
            self.oplog.hold(holder.slot, tuple((queues[i], queues[i].entries[-1]) for i in covered))

    # -- sessions ------------------------------------------------------------
    def add_session(self, slot: int, ssn: Any) -> None:
        """Session ``ssn`` has the accounting slot ``slot`` (its transfers carry it)."""
        self.sessions[slot] = ssn

    def drop_session(self, slot: int) -> None:
        """A closed session's transfers are forgotten: never held, never reported."""
        ssn = self.sessions.pop(slot, None)
        if ssn is not None:
            for holds in self.holds.values():
                holds.held_sessions.pop(ssn, None)
            for holder in self.holders.values():  # its tokens go when released (ignored then) or with the holder
                holder.held_sessions.pop(ssn, None)
        self.acct.drop_session(slot)

    # -- the batch ----------------------------------------------------------------
    def apply(self) -> list[ops.CompletedRange]:
        """Run the op log; returns the completed command ranges (session slot, first, last)."""
        if not self.oplog:
            return []
        ops, seqs, runs = self.oplog.take()
        if self.unheld:  # let go by dequeues in this log, before anything it holds anew
            self._tell_unheld()
        try:
            completions, holds, transitions = self.acct.apply(ops)
        except ops.AccountingError:
            log.exception("accounting refused an op: this is a broker bug")
            return []
        # Transitions first: a resume in this log lets go every hold made before it, and
        # moves its queue's generation on; a hold of an older generation is already let go.
        if transitions:
            self._transitions(transitions, None)
        if holds:
            self._hold(holds, seqs, runs)
        return completions

    def _hold(self, holds: Sequence[ops.Hold], seqs: list[Any], runs: list[LoggedRun]) -> None:
        """Record the holds of an applied log: each queue's tokens and held sessions
        (a session is told when a queue first holds it), or an outside holder's arrivals."""
        queues, sessions, all_holds = self.queues, self.sessions, self.holds
        woken: dict[Holder, None] = {}
        if runs:  # OP_HOLDs with bare entries: as uniform runs if that is all there is, else as pairs
            if self._runs_only(holds, seqs, runs):
                return
            seqs = _held_messages(seqs, runs)
        if holds and holds[0][3] not in queues and self._one_holder(holds):
            # All of one outside holder (the store's usual input): handed over with no Python call per hold.
            holder = self.holders[holds[0][3]]
            if holder.label is None:  # named (overfull, alarm): the loop below tells its sessions
                holder.arrived += zip(map(_token_of, holds), map(seqs.__getitem__, map(_op_index_of, holds)),
                                      strict=True)
                holder.wake()
                return
        for op_index, token, session_slot, slot in holds:
            qholds = all_holds.get(slot)
            if qholds is None:  # an outside holder's hold (a slot is a queue's or a holder's)
                holder = self.holders[slot]
                holder.arrived.append((token, seqs[op_index]))
                woken[holder] = None
                if holder.label is not None:
                    ssn = sessions.get(session_slot)
                    if ssn is not None:
                        holder.token_sessions[token] = ssn
                        n = holder.held_sessions.get(ssn, 0)
                        holder.held_sessions[ssn] = n + 1
                        if not n:
                            self.tell(ssn, holder.label, True, True)
                continue
            if generation_of(token) != qholds.generation:
                continue
            ssn = sessions.get(session_slot)
            qholds.tokens[seqs[op_index]] = (token, ssn)
            if ssn is None:
                continue
            n = qholds.held_sessions.get(ssn, 0)
            qholds.held_sessions[ssn] = n + 1
            if not n:
                self.tell(ssn, queues[slot].name, True, False)
        for holder in woken:
            holder.wake()

    def _runs_only(self, holds: Sequence[ops.Hold], seqs: list[Any], runs: list[LoggedRun]) -> bool:
        """The usual input of durable queues: every hold is an OP_HOLD of
        ``runs``, all of one unnamed outside holder. Then it gets one uniform
        run per run of the log (Holder.take_runs) and this returns True; else
        False, with nothing done."""
        if len(holds) * 4 != sum(map(_run_ops, runs)):
            return False
        words = getattr(holds, "words", None)  # the C accounting's: by column, no tuple per hold
        slots = words[3::4] if words is not None else list(map(_slot_of, holds))
        slot = slots[0]
        if slot in self.queues or slots.count(slot) != len(slots):
            return False
        holder = self.holders[slot]
        if holder.label is not None:
            return False
        if words is not None:
            indices, tokens = words[0::4], words[1::4].tolist()
        else:
            indices, tokens = list(map(_op_index_of, holds)), list(map(_token_of, holds))
        entries = list(map(seqs.__getitem__, indices))
        given: list[HeldRun] = []
        i = 0
        for start, nops, q in runs:
            n = nops // 4
            # Its holds, in op order: the first and the last at its first and last OP_HOLD (one op in four).
            if indices[i] != start + 2 or indices[i + n - 1] != start + nops - 2:
                return False
            first = seqs[start + 1]  # the first transfer's OP_ENQUEUE: its sequence number
            given.append((q, tokens, entries, range(first, first + n)) if n == len(holds)
                         else (q, tokens[i:i + n], entries[i:i + n], range(first, first + n)))
            i += n
        if holder.arrived:  # holds given earlier wait as pairs: these come after them, as pairs too
            holder.arrived += [(token, ((q, entry),)) for q, tokens, entries, _ in given
                               for token, entry in zip(tokens, entries, strict=True)]
        else:
            holder.runs += given
        holder.wake()
        return True

    @staticmethod
    def _one_holder(holds: Sequence[ops.Hold]) -> bool:
        """Whether every hold of ``holds`` has the first one's slot."""
        slots = list(map(_slot_of, holds))
        return slots.count(slots[0]) == len(slots)

    def _tell_unheld(self) -> None:
        """Tell each session in ``unheld`` that its queue holds none of its transfers now."""
        unheld = self.unheld.copy()
        self.unheld.clear()  # in place: every QueueHolds appends to this list
        for qholds, ssn in unheld:
            if self.holds.get(qholds.slot) is not qholds or ssn in qholds.held_sessions:  # gone, or held again
                continue
            self.tell(ssn, self.queues[qholds.slot].name, False, False)

    def _transitions(self, transitions: list[ops.Transition], settings: QueueSettings | None) -> None:
        for queue_slot, flow_on, count, nbytes in transitions:
            q = self.queues[queue_slot]
            log.info(describe_transition(printable(q.name), settings or q.settings, flow_on, count, nbytes))
            if not flow_on:
                self.released(q)

    def released(self, q: Queue) -> None:
        """``q`` let all its holds go: its tokens are stale (the accounting moved
        on to a new generation), and the sessions it held are told. The stale
        tokens are dropped as their messages leave (release_token), not here:
        a release of 10,000 holds would otherwise free 10,000 of them before
        the first completion is reported."""
        qholds = self.holds[q.slot]
        qholds.generation = next_generation(qholds.generation)
        for ssn in qholds.held_sessions:
            self.tell(ssn, q.name, False, False)
        qholds.held_sessions.clear()


def holders_of(queues: Sequence[Queue]) -> dict[Holder, list[int]]:
    """The outside holders ``queues`` carry, in the order first carried, each
    with the indices (into ``queues``) of the queues that carry it."""
    holders: dict[Holder, list[int]] = {}
    for i, q in enumerate(queues):
        for holder in q.holders:
            holders.setdefault(holder, []).append(i)
    return holders
