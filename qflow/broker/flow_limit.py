"""Producer flow control: the flow limit that watches each queue, and the
completions it holds back. No I/O.

A queue announces every enqueue and dequeue by appending an op to the log
kept here (``FlowControl.log``; the format is qflow.broker.ops), and a
transfer opens and closes its own entry in the same log. Once per input
batch, :meth:`FlowControl.apply` hands the whole log to the accounting (C, or
its Python twin: qflow.broker.accounting) in one call. The accounting keeps
each queue's count and bytes as qpidd's QueueFlowLimit does, applies the
manual's rules, and counts each transfer's holders:

* "When the total number of enqueued messages is greater than [stop], the
  queue's flow control state transitions to ON" (either unit);
* "it remains ON until the total number of enqueued messages is less than
  [resume]" (and, with both units, until both are satisfied);
* "The Broker enforces flow control by delaying the completion of the
  Message.Transfer command that causes a message to be delivered to a queue
  with active flow control ... until flow control state transitions to OFF for
  all queues that are a destination for that command": a transfer is held by
  its routing (until every destination has its message), by each queue
  that was stopped when the message arrived, and by each outside holder (a
  :class:`Holder`: the durable store) of its queues; it completes when no
  holder is left. A held message dequeued while the flow is still ON is
  released by that queue at once, as QueueFlowLimit does.

What comes back is applied here: each hold is remembered by the queue's
:class:`FlowLimit` (so the dequeue of that message can release it) or handed
to its outside holder, the sessions concerned are told
(``session.flow-notice``: flow control's holds only), transitions are logged,
and the completed command ranges go back to the broker.

A session is *held by* a queue while that queue holds at least one of its
transfers: it is told ``held`` when the first is held, and ``not held`` when
the last is let go, on its own (its message dequeued while the flow stays
on: :meth:`FlowLimit.release_token`) or with all the others (flow off, the
queue deleted or given new thresholds: :meth:`FlowControl.released`). The
management views and the client's ``held_by`` follow those notices. All of
it is work per *held* message only: a queue holding nothing has no tokens,
and its dequeues take none of these steps.
"""

from __future__ import annotations

import logging
import struct
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import repeat
from operator import itemgetter
from struct import Struct
from typing import TYPE_CHECKING, Any

from qflow.broker.flow import QueueSettings, describe_transition
from qflow.broker.ops import (
    OP_HOLD,
    OP_RELEASE,
    OP_WORDS,
    Accounting,
    AccountingError,
    CompletedRange,
    Hold,
    Transition,
)
from qflow.protocol.entries import Entry
from qflow.protocol.names import printable

if TYPE_CHECKING:
    from qflow.broker.queue import Queue
    from qflow.broker.session import BrokerSession

log = logging.getLogger("qflow.broker")

# One op of the log, packed: a precompiled Struct into a bytearray costs half
# of array('q').extend with a tuple.
pack_op = Struct(f"={OP_WORDS}q").pack
_op_index_of, _token_of, _session_of, _slot_of = itemgetter(0), itemgetter(1), itemgetter(2), itemgetter(3)  # of a Hold
_run_ops = itemgetter(1)  # of a FlowControl.log_runs item


def _held_messages(seqs: list[Any], runs: list[tuple[int, int, Queue]]) -> list[Any]:
    """``seqs`` (an applied log's, no longer shared) with each bare entry of
    ``runs`` made the ``((queue, entry),)`` every other OP_HOLD carries."""
    for start, nops, q in runs:
        holds = range(start + 2, start + nops, 4)  # per transfer: TRANSFER, ENQUEUE, HOLD, END
        seqs[start + 2:start + nops:4] = [((q, seqs[i]),) for i in holds]
    return seqs


class FlowLimit:
    """One queue's flow limit, as the broker sees it: the transfers it holds
    (by message sequence number) and the sessions it has told so, and the
    senders writing to it (for the manual's worst case). Its thresholds and
    ON/OFF state live in the accounting, under ``slot``."""

    __slots__ = ("slot", "tokens", "held_sessions", "generation", "unheld", "writers", "worst_warned")

    def __init__(self, slot: int, unheld: list[tuple[FlowLimit, Any]]) -> None:
        self.slot = slot
        # seq -> (the accounting's hold token, the session whose transfer it holds), for
        # messages whose transfer is held here; emptied when the queue lets all go.
        self.tokens: dict[int, tuple[int, Any]] = {}
        # Session -> how many of its transfers are held here, in the order they were first
        # held: a dict, not a set, so the release notices go out in that order (a set's order
        # follows object addresses, and differed from run to run).
        self.held_sessions: dict[Any, int] = {}
        # The accounting's generation of this queue's holds (the high half of a token): it
        # moves on each time the queue lets all go (FlowControl.released), as in the accounting.
        self.generation = 0
        self.unheld = unheld  # FlowControl.unheld, where a session no longer held here waits to be told
        self.writers: dict[Any, int] = {}  # session -> its announced sender capacity
        self.worst_warned = False

    def release_token(self, seq: int) -> int:
        """The hold token of message ``seq`` if its transfer is held here
        (forgotten now: the message is being dequeued, and the accounting lets
        it go with this token), else -1. A session whose last transfer held
        here this was is queued to be told (FlowControl.apply)."""
        if not self.tokens:  # the usual case: nothing held here
            return -1
        held = self.tokens.pop(seq, None)
        if held is None:
            return -1
        token, ssn = held
        if token >> 32 != self.generation:  # let go already, with all the queue held (FlowControl.released)
            return -1
        n = self.held_sessions.get(ssn)
        if n is not None:  # None: the session was dropped since
            if n > 1:
                self.held_sessions[ssn] = n - 1
            else:
                del self.held_sessions[ssn]
                self.unheld.append((self, ssn))
        return token

    def worst_case(self, settings: QueueSettings) -> int:
        """The manual's worst case: stop threshold plus the capacities of the
        senders currently writing to the queue (0 without a count threshold)."""
        if not settings.stop_count:
            return 0
        return settings.stop_count + sum(self.writers.values())

    def note_writer(self, q: Queue, ssn: BrokerSession) -> None:
        """``ssn`` writes to ``q`` with its current sender capacity."""
        if self.writers.get(ssn) != ssn.capacity:
            self.writers[ssn] = ssn.capacity
            self.check_worst_case(q)

    def check_worst_case(self, q: Queue) -> None:
        """Warn once when the manual's worst case no longer fits the queue."""
        s = q.settings
        worst = self.worst_case(s)
        over = bool(s.stop_count and s.max_count and worst > s.max_count)
        if over and not self.worst_warned:
            log.warning('queue "%s": worst-case depth %d (stop %d + sender capacities %d) exceeds qpid.max_count %d;'
                        " a transfer can still be rejected despite flow control",
                        printable(q.name), worst, s.stop_count, sum(self.writers.values()), s.max_count)
        self.worst_warned = over


# What a holder is handed for each transfer it holds: (its token, the messages held: (queue, entry) for
# each of the transfer's queues that carry the holder).
Held = tuple[int, tuple[tuple["Queue", Entry], ...]]
# A run of holds of one queue's transfers, a message each (Holder.take_runs): (queue, tokens, entries,
# their sequence numbers: a range). They come from one run of transfer frames (native/transfers.h), so
# the entries have the same exchange, routing key and properties, but for a message id.
HeldRun = tuple["Queue", list[int], list[Entry], range]
# What a holder may be told of dequeues: (queue, the entries dequeued from it).
Dequeued = Callable[["Queue", Sequence[Entry]], None]


def _nothing() -> None:
    pass


class Holder:
    """An outside holder of transfers' completion: the durable store
    (qflow.store.message_store) is one, holding a persistent message's transfer
    until its write is synced.

    Queues carry it (:meth:`Queue.add_holder`). A transfer routed to any of them
    is held by it once, however many of its queues carry it: the store writes a
    transfer's messages together and one sync covers them, so one release
    should complete the transfer. After each apply, its new holds wait in
    :meth:`take` and ``wake`` is called; :meth:`release` lets go of them, and
    the transfer completes once its other holders (routing, stopped queues,
    other outside holders) have let go too. Created by :meth:`FlowControl.add_holder`."""

    __slots__ = ("slot", "name", "control", "arrived", "runs", "wake", "dequeued", "deleted", "removed", "label",
                 "held_sessions", "token_sessions", "tracks")

    def __init__(self, slot: int, name: str, control: FlowControl, wake: Callable[[], None] | None,
                 dequeued: Dequeued | None = None) -> None:
        self.slot = slot  # the accounting's number for it (queues and holders share the numbering)
        self.name = name
        self.control = control
        self.arrived: list[Held] = []  # holds given since the last take()
        # Uniform runs of holds given since the last take_runs(). Every one of them came before every
        # hold in ``arrived`` (FlowControl._runs_only keeps it so), so take() keeps arrival order.
        self.runs: list[HeldRun] = []
        self.wake = wake or _nothing  # called after an apply that gave it holds
        # Told of every message dequeued from a queue that carries it, as it happens (the store
        # writes the removal); queues without holders pay nothing for it.
        self.dequeued = dequeued
        self.deleted: Callable[[Queue], None] | None = None  # told of a deletion of a queue that carries it
        self.removed = False
        # While not None, the sessions it holds are told so under this name (session.flow-notice,
        # heldBy), as a stopped queue's are: see FlowControl.name_holds.
        self.label: str | None = None
        # Whether naming it also names the sessions of the holds it has already (asked of the
        # accounting then: FlowControl.name_holds). Either way an unnamed hold costs nothing more.
        self.tracks = False
        self.held_sessions: dict[Any, int] = {}  # session -> its transfers held, while named
        self.token_sessions: dict[int, Any] = {}  # hold token -> its session, while named

    def __repr__(self) -> str:
        return f"<Holder {self.name!r} slot {self.slot}{' removed' if self.removed else ''}>"

    def take(self) -> list[Held]:
        """The holds given to this holder since the last call: ``(token, messages)``
        per transfer, ``messages`` the ``(queue, entry)`` it holds (entries as
        qflow.protocol.entries stores them); those :meth:`take_runs` has not
        taken come first, made pairs."""
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
        """Let go of these holds (tokens from :meth:`take`). They are ops in the
        log: the next apply (:meth:`Broker.flush`: call it when no input batch is
        under way) completes each transfer left without a holder. A token of a
        hold that is gone (released already, its session closed) is ignored;
        after :meth:`FlowControl.remove_holder` this does nothing: removing
        released every hold."""
        if self.removed:
            return
        control, slot = self.control, self.slot
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        if self.token_sessions:
            control.let_go(self, tokens)
        try:
            column = array("q", tokens)
        except (TypeError, OverflowError):
            for token in tokens:  # name the bad one (nothing was logged)
                try:
                    pack_op(OP_RELEASE, slot, token, 0, 0)
                except struct.error:
                    raise ValueError(f"holder {self.name!r}: {token!r} is not a hold token") from None
            raise ValueError(f"holder {self.name!r}: a token given is not a hold token") from None
        # The ops (OP_RELEASE, slot, token, 0, 0) built column by column: no Python call per token
        # (the store releases a whole commit's transfers at once).
        n = len(column)
        ops = array("q", bytes(8 * OP_WORDS * n))
        ops[0::OP_WORDS] = array("q", (OP_RELEASE,)) * n
        ops[1::OP_WORDS] = array("q", (slot,)) * n
        ops[2::OP_WORDS] = column
        control.log += ops
        control.log_seqs += [None] * n


class FlowControl:
    """Every queue's flow limit and every transfer's completion, batched.

    Writers append to ``log`` (with ``pack_op``) and, per op, to ``log_seqs``:
    the message sequence number it enqueued, for OP_HOLD the messages held
    (``(queue, entry)`` pairs), else None; :meth:`apply` runs them. A run of
    transfers to one queue with one outside holder may log, for each OP_HOLD,
    the bare entry instead, and say in ``log_runs`` which ops and which queue
    (Broker's transfer runs: no tuple per message). ``dirty`` collects the
    sessions with something to report."""

    def __init__(self, accounting: Accounting) -> None:
        self.acct = accounting
        self.log = bytearray()
        self.log_seqs: list[Any] = []
        # (first op index, op count, queue): log_seqs's runs whose OP_HOLDs carry bare entries on that queue
        self.log_runs: list[tuple[int, int, Queue]] = []
        self.queues: dict[int, Queue] = {}  # by accounting slot
        self.holders: dict[int, Holder] = {}  # by accounting slot
        self.sessions: dict[int, BrokerSession] = {}  # by accounting slot
        self.dirty: dict[BrokerSession, None] = {}
        # (flow limit, session) whose last transfer held by that queue was let go by a
        # dequeue since the last apply (FlowLimit.release_token): told at the next apply.
        self.unheld: list[tuple[FlowLimit, Any]] = []

    # -- queues ---------------------------------------------------------------
    def add_queue(self, settings: QueueSettings) -> FlowLimit:
        slot = self.acct.add_queue()
        self.acct.set_thresholds(slot, settings.stop_count, settings.resume_count, settings.stop_size,
                                 settings.resume_size)
        return FlowLimit(slot, self.unheld)

    def attach(self, q: Queue) -> None:
        self.queues[q.flow.slot] = q

    def remove_queue(self, q: Queue) -> list[CompletedRange]:
        """The queue is gone: its held transfers are no longer held by it."""
        self.apply()
        del self.queues[q.flow.slot]
        self.released(q)
        return self.acct.remove_queue(q.flow.slot)

    def set_thresholds(self, q: Queue, settings: QueueSettings) -> list[CompletedRange]:
        """New thresholds for a live queue: its flow state is re-evaluated now."""
        self.apply()
        completions, transitions = self.acct.set_thresholds(
            q.flow.slot, settings.stop_count, settings.resume_count, settings.stop_size, settings.resume_size)
        self._transitions(transitions, settings)
        return completions

    def stats(self, q: Queue) -> tuple[int, int, bool, int, int]:
        """(count, bytes, flow on, times stopped, transfers held) as the accounting has them."""
        return self.acct.stats(q.flow.slot)

    # -- outside holders -------------------------------------------------------
    def add_holder(self, name: str, wake: Callable[[], None] | None = None,
                   dequeued: Dequeued | None = None) -> Holder:
        """A new outside holder; it holds nothing until a queue carries it."""
        holder = Holder(self.acct.add_holder(), name, self, wake, dequeued)
        self.holders[holder.slot] = holder
        return holder

    def remove_holder(self, holder: Holder) -> list[CompletedRange]:
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
                self._tell_holder(ssn, holder.label, False)
            holder.held_sessions.clear()
            holder.token_sessions.clear()
            holder.label = None
            return
        if holder.label is not None:
            return
        holder.label = label
        held = holder.held_sessions
        if holder.tracks:  # the holds applied so far, less those let go since (their releases still in the log)
            released = self._logged_releases(holder)
            sessions = self.sessions
            holder.token_sessions = {token: sessions.get(slot) for token, slot in self.acct.holds_of(holder.slot)
                                     if token not in released}
        for ssn in holder.token_sessions.values():
            if ssn is not None and not ssn.closed:
                held[ssn] = held.get(ssn, 0) + 1
        for ssn in held:
            self._tell_holder(ssn, label, True)

    def _logged_releases(self, holder: Holder) -> set[int]:
        """The tokens ``holder`` released in the log not applied yet."""
        ops = memoryview(self.log).cast("q")
        return {ops[i + 2] for i in range(0, len(ops), OP_WORDS) if ops[i] == OP_RELEASE and ops[i + 1] == holder.slot}

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
                self._tell_holder(ssn, holder.label, False)

    def _tell_holder(self, ssn: BrokerSession, label: str, held: bool) -> None:
        if ssn.closed:
            return
        if held:
            ssn.holder_since[label] = time.time()
        else:
            ssn.holder_since.pop(label, None)
        ssn.out.flow_notice(label, held, True)
        self.dirty[ssn] = None

    def hold(self, queues: Sequence[Queue]) -> None:
        """In an open transfer, after its enqueues on ``queues``: one OP_HOLD per
        outside holder that any of them carry, in the order first carried."""
        for holder, covered in holders_of(queues).items():
            self.log += pack_op(OP_HOLD, holder.slot, 0, 0, 0)
            self.log_seqs.append(tuple((queues[i], queues[i].entries[-1]) for i in covered))

    # -- sessions ------------------------------------------------------------
    def drop_session(self, ssn: BrokerSession) -> None:
        """A closed session's transfers are forgotten: never held, never reported."""
        for q in self.queues.values():
            q.flow.held_sessions.pop(ssn, None)
            q.flow.writers.pop(ssn, None)
        for holder in self.holders.values():  # its tokens go when released (ignored then) or with the holder
            holder.held_sessions.pop(ssn, None)
        self.acct.drop_session(ssn.slot)
        self.sessions.pop(ssn.slot, None)
        self.dirty.pop(ssn, None)

    # -- the batch ----------------------------------------------------------------
    def apply(self) -> list[CompletedRange]:
        """Run the op log; returns the completed command ranges (session slot, first, last)."""
        if not self.log:
            return []
        ops, seqs, runs = memoryview(self.log).cast("q"), self.log_seqs, self.log_runs
        self.log = bytearray()
        self.log_seqs = []
        if runs:
            self.log_runs = []
        if self.unheld:  # let go by dequeues in this log, before anything it holds anew
            self._tell_unheld()
        try:
            completions, holds, transitions = self.acct.apply(ops)
        except AccountingError:
            log.exception("accounting refused an op: this is a broker bug")
            return []
        # Transitions first: a resume in this log lets go every hold made before it, and
        # moves its queue's generation on; a hold of an older generation is already let go.
        if transitions:
            self._transitions(transitions, None)
        if holds:
            self._hold(holds, seqs, runs)
        return completions

    def _hold(self, holds: Sequence[Hold], seqs: list[Any], runs: list[tuple[int, int, Queue]]) -> None:
        """Record the holds of an applied log: each queue's tokens and held sessions
        (a session is told when a queue first holds it), or an outside holder's arrivals."""
        queues, sessions = self.queues, self.sessions
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
            q = queues.get(slot)
            if q is None:  # an outside holder's hold (a slot is a queue's or a holder's)
                holder = self.holders[slot]
                holder.arrived.append((token, seqs[op_index]))
                woken[holder] = None
                if holder.label is not None:
                    ssn = sessions.get(session_slot)
                    if ssn is not None:
                        holder.token_sessions[token] = ssn
                        if holder.label is not None:
                            n = holder.held_sessions.get(ssn, 0)
                            holder.held_sessions[ssn] = n + 1
                            if not n:
                                self._tell_holder(ssn, holder.label, True)
                continue
            flow = q.flow
            if token >> 32 != flow.generation:
                continue
            ssn = sessions.get(session_slot)
            flow.tokens[seqs[op_index]] = (token, ssn)
            if ssn is None:
                continue
            n = flow.held_sessions.get(ssn, 0)
            flow.held_sessions[ssn] = n + 1
            if not n:
                ssn.held_since[q.name] = time.time()
                ssn.out.flow_notice(q.name, True)
                self.dirty[ssn] = None
        for holder in woken:
            holder.wake()

    def _runs_only(self, holds: Sequence[Hold], seqs: list[Any], runs: list[tuple[int, int, Queue]]) -> bool:
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
    def _one_holder(holds: Sequence[Hold]) -> bool:
        """Whether every hold of ``holds`` has the first one's slot."""
        slots = list(map(_slot_of, holds))
        return slots.count(slots[0]) == len(slots)

    def _tell_unheld(self) -> None:
        """Tell each session in ``unheld`` that its queue holds none of its transfers now."""
        unheld = self.unheld.copy()
        self.unheld.clear()  # in place: every FlowLimit appends to this list
        for flow, ssn in unheld:
            q = self.queues.get(flow.slot)
            if q is None or q.flow is not flow or ssn.closed or ssn in flow.held_sessions:  # gone, or held again
                continue
            self._tell(ssn, q)

    def _transitions(self, transitions: list[Transition], settings: QueueSettings | None) -> None:
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
        flow = q.flow
        flow.generation = (flow.generation + 1) & 0x7FFFFFFF  # as the accounting's release_all
        for ssn in flow.held_sessions:
            self._tell(ssn, q)
        flow.held_sessions.clear()

    def _tell(self, ssn: BrokerSession, q: Queue) -> None:
        """``ssn`` is no longer held by ``q``."""
        ssn.held_since.pop(q.name, None)
        ssn.out.flow_notice(q.name, False)
        self.dirty[ssn] = None


def holders_of(queues: Sequence[Queue]) -> dict[Holder, list[int]]:
    """The outside holders ``queues`` carry, in the order first carried, each
    with the indices (into ``queues``) of the queues that carry it."""
    holders: dict[Holder, list[int]] = {}
    for i, q in enumerate(queues):
        for holder in q.holders:
            holders.setdefault(holder, []).append(i)
    return holders
