"""A session as the broker sees it: its incoming commands, its deliveries
awaiting accept, its subscriptions, and where its output goes. No I/O.

The model tells a session its news (deliveries, completions, results,
exceptions, flow notices) through ``out``, the session output its connection
gave it (qflow.protocol.session_output: how those become frames is the
protocol's business), and calls ``out.wake()`` once per batch that gave it
news. The model knows nothing of the connection behind it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qflow.protocol.commands import IncomingCommands
from qflow.protocol.entries import Entry
from qflow.protocol.session_output import SessionOutput

if TYPE_CHECKING:
    from qflow.broker.queue import Consumer, Queue


class BrokerSession:
    """One attached session.

    Deliveries awaiting accept are kept in delivery-id order in two parallel
    lists (the entry, and its queue), ``unacked[did - unacked_base]``, with
    None where a delivery was accepted, released or needs no accept. Ids are
    consecutive per session, so an accept of a range is a walk over a slice.
    """

    __slots__ = ("channel", "name", "slot", "out", "commands",
                 "next_delivery", "unacked", "unacked_queues", "unacked_base", "unacked_count", "consumers",
                 "capacity", "closed", "held_since", "holder_since", "last_queues", "user", "published", "peer")

    def __init__(self, channel: int, name: str, slot: int, out: SessionOutput | None = None,
                 user: str = "", peer: str = "") -> None:
        self.channel = channel
        self.peer = peer  # its connection's address, for the change log ("" in memory)
        self.user = user  # its connection's authenticated user (the ACL's subject, and the views)
        # The ACL's publish decisions for this session, by (exchange, routing key): None
        # allowed, else the denial. Decided once each, forgotten on reload (Broker.set_acl).
        self.published: dict[tuple[str, str], Any] = {}
        self.name = name
        self.slot = slot  # the accounting's session number, never reused
        self.out = out if out is not None else SessionOutput(channel)  # tests and benchmarks read it in memory
        self.commands = IncomingCommands()
        self.next_delivery = 0
        self.unacked: list[Entry | None] = []
        self.unacked_queues: list[Queue | None] = []
        self.unacked_base = 0  # the delivery id of unacked[0]
        self.unacked_count = 0  # entries in unacked that are not None
        self.consumers: dict[str, Consumer] = {}
        self.capacity = 0  # announced by the client's senders
        self.closed = False
        self.last_queues: Any = None  # the destinations of its last transfer
        self.held_since: dict[str, float] = {}  # queue name -> wall time it began holding us (management view)
        # A named outside holder ("memory alarm", "store disk quota") -> wall time it began holding us
        self.holder_since: dict[str, float] = {}

    def take_unacked(self, first: int, last: int) -> tuple[list[Queue], list[Entry]]:
        """Remove the deliveries awaiting accept with ids in [first, last];
        returns their queues and entries, in delivery order."""
        base = self.unacked_base
        entries, queues = self.unacked, self.unacked_queues
        lo = max(first, base) - base
        hi = min(last - base + 1, len(entries))
        if lo >= hi:
            return [], []
        taken_q = queues[lo:hi]
        taken_e = entries[lo:hi]
        entries[lo:hi] = queues[lo:hi] = [None] * (hi - lo)
        if None in taken_e:  # holes: already accepted, released, or needing no accept
            taken_q = [q for q in taken_q if q is not None]
            taken_e = [e for e in taken_e if e is not None]
        if taken_e:
            self.unacked_count -= len(taken_e)
            self._trim()
        return taken_q, taken_e

    def take_all_unacked(self) -> tuple[list[Queue], list[Entry]]:
        return self.take_unacked(self.unacked_base, self.unacked_base + len(self.unacked))

    def _trim(self) -> None:
        entries = self.unacked
        if not self.unacked_count:
            self.unacked_base += len(entries)
            entries.clear()
            self.unacked_queues.clear()
            return
        i = 0
        while entries[i] is None:
            i += 1
        if i:
            del entries[:i]
            del self.unacked_queues[:i]
            self.unacked_base += i
