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
  its routing (until every destination has its message) and by each queue
  that was stopped when the message arrived; it completes when no holder is
  left. A held message dequeued while the flow is still ON is released by that
  queue at once, as QueueFlowLimit does.

What comes back is applied here: each hold is remembered by the queue's
:class:`FlowLimit` (so the dequeue of that message can release it), the
sessions concerned are told (``session.flow-notice``), transitions are
logged, and the completed command ranges go back to the broker.
"""

from __future__ import annotations

import logging
import time
from struct import Struct
from typing import TYPE_CHECKING, Any

from qflow.broker.flow import QueueSettings, describe_transition
from qflow.broker.ops import OP_WORDS, Accounting, AccountingError, Completion, Transition

if TYPE_CHECKING:
    from qflow.broker.queue import Queue
    from qflow.broker.session import BrokerSession

log = logging.getLogger("qflow.broker")

# One op of the log, packed: a precompiled Struct into a bytearray costs half
# of array('q').extend with a tuple.
pack_op = Struct(f"={OP_WORDS}q").pack


class FlowLimit:
    """One queue's flow limit, as the broker sees it: the transfers it holds
    (by message sequence number) and the sessions it has told so, and the
    senders writing to it (for the manual's worst case). Its thresholds and
    ON/OFF state live in the accounting, under ``slot``."""

    __slots__ = ("slot", "tokens", "held_sessions", "writers", "worst_warned")

    def __init__(self, slot: int) -> None:
        self.slot = slot
        # seq -> the accounting's hold token, for messages whose transfer is held
        # here: only while this queue's flow is stopped.
        self.tokens: dict[int, int] = {}
        # Sessions told their transfers are held here, in the order they were told: a dict,
        # not a set, so the release notices go out in that order (a set's order follows
        # object addresses, and differed from run to run).
        self.held_sessions: dict[Any, None] = {}
        self.writers: dict[Any, int] = {}  # session -> its announced sender capacity
        self.worst_warned = False

    def release_token(self, seq: int) -> int:
        """The hold token of message ``seq`` if its transfer is held here
        (forgotten now: the message is being dequeued), else -1."""
        return self.tokens.pop(seq, -1) if self.tokens else -1

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
                        q.name, worst, s.stop_count, sum(self.writers.values()), s.max_count)
        self.worst_warned = over


class FlowControl:
    """Every queue's flow limit and every transfer's completion, batched.

    Writers append to ``log`` (with ``pack_op``) and, per op, the message
    sequence number it enqueued (or None) to ``log_seqs``; :meth:`apply` runs
    them. ``dirty`` collects the sessions with something to report."""

    def __init__(self, accounting: Accounting) -> None:
        self.acct = accounting
        self.log = bytearray()
        self.log_seqs: list[int | None] = []
        self.queues: dict[int, Queue] = {}  # by accounting slot
        self.sessions: dict[int, BrokerSession] = {}  # by accounting slot
        self.dirty: dict[BrokerSession, None] = {}

    # -- queues ---------------------------------------------------------------
    def add_queue(self, settings: QueueSettings) -> FlowLimit:
        slot = self.acct.add_queue()
        self.acct.set_thresholds(slot, settings.stop_count, settings.resume_count, settings.stop_size,
                                 settings.resume_size)
        return FlowLimit(slot)

    def attach(self, q: Queue) -> None:
        self.queues[q.flow.slot] = q

    def remove_queue(self, q: Queue) -> list[Completion]:
        """The queue is gone: its held transfers are no longer held by it."""
        self.apply()
        del self.queues[q.flow.slot]
        self.released(q)
        return self.acct.remove_queue(q.flow.slot)

    def set_thresholds(self, q: Queue, settings: QueueSettings) -> list[Completion]:
        """New thresholds for a live queue: its flow state is re-evaluated now."""
        self.apply()
        completions, transitions = self.acct.set_thresholds(
            q.flow.slot, settings.stop_count, settings.resume_count, settings.stop_size, settings.resume_size)
        self._transitions(transitions, settings)
        return completions

    def stats(self, q: Queue) -> tuple[int, int, bool, int, int]:
        """(count, bytes, flow on, times stopped, transfers held) as the accounting has them."""
        return self.acct.stats(q.flow.slot)

    # -- sessions ------------------------------------------------------------
    def drop_session(self, ssn: BrokerSession) -> None:
        """A closed session's transfers are forgotten: never held, never reported."""
        for q in self.queues.values():
            q.flow.held_sessions.pop(ssn, None)
            q.flow.writers.pop(ssn, None)
        self.acct.drop_session(ssn.slot)
        self.sessions.pop(ssn.slot, None)
        self.dirty.pop(ssn, None)

    # -- the batch ----------------------------------------------------------------
    def apply(self) -> list[Completion]:
        """Run the op log; returns the completed command ranges (session slot, first, last)."""
        if not self.log:
            return []
        ops, seqs = memoryview(self.log).cast("q"), self.log_seqs
        self.log = bytearray()
        self.log_seqs = []
        try:
            completions, holds, transitions = self.acct.apply(ops)
        except AccountingError:
            log.exception("accounting refused an op: this is a broker bug")
            return []
        for op_index, token, session_slot, queue_slot in holds:
            q = self.queues[queue_slot]
            q.flow.tokens[seqs[op_index]] = token  # type: ignore[index]
            ssn = self.sessions.get(session_slot)
            if ssn is not None and ssn not in q.flow.held_sessions:
                q.flow.held_sessions[ssn] = None
                ssn.held_since[q.name] = time.time()
                ssn.out.flow_notice(q.name, True)
                self.dirty[ssn] = None
        self._transitions(transitions, None)
        return completions

    def _transitions(self, transitions: list[Transition], settings: QueueSettings | None) -> None:
        for queue_slot, flow_on, count, nbytes in transitions:
            q = self.queues[queue_slot]
            log.info(describe_transition(q.name, settings or q.settings, flow_on, count, nbytes))
            if not flow_on:
                self.released(q)

    def released(self, q: Queue) -> None:
        """Tell the sessions held by ``q`` that it holds them no more."""
        for ssn in q.flow.held_sessions:
            ssn.held_since.pop(q.name, None)
            ssn.out.flow_notice(q.name, False)
            self.dirty[ssn] = None
        q.flow.held_sessions.clear()
