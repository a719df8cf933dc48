"""No unbounded work in one step (issue 17), in the in-memory harness.

Each case is one of the issue's freezes, scaled down, checked without a clock:
a long command (purge, delete, remove-through) works in steps of at most
``SLICE`` messages and another connection's command is answered between two
steps; the other freezes were loops costing per message times per message,
now counted (calls of the inner function) to stay proportional to the work.
Past the new bounds (ranges per accept/release, waiting syncs per session),
the command is refused with a clear error, and the session carries on.
"""

from __future__ import annotations

import pytest
import trio

import qflow
import qflow.broker.broker as broker_module
import qflow.broker.commands as commands_module
import qflow.broker.queue as queue_module
import qflow.protocol.commands as protocol_commands
from qflow import protocol as P
from qflow.protocol.ranges import RangeSet
from qflow.testing import Harness, MemoryClient, MemorySession

SLICE = 100


@pytest.fixture
def sliced(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(broker_module, "SLICE", SLICE)
    return SLICE


def fill(harness: Harness, ssn: MemorySession, queue: str, n: int, body: bytes = b"m") -> None:
    for i in range(n):
        ssn.transfer(queue, body + str(i).encode())
        if i % 5000 == 4999:
            harness.run()
    harness.run()


def two_clients() -> tuple[Harness, MemoryClient, MemorySession, MemoryClient, MemorySession]:
    harness = Harness()
    a = harness.connect("a")
    b = harness.connect("b")
    return harness, a, a.session("a"), b, b.session("b")


def record_batches(monkeypatch: pytest.MonkeyPatch, method: str = "dequeue_many") -> list[int]:
    """The size of each batch handed to Queue.``method`` from now on."""
    sizes: list[int] = []
    real = getattr(queue_module.Queue, method)

    def recording(self, entries):
        sizes.append(len(entries))
        return real(self, entries)

    monkeypatch.setattr(queue_module.Queue, method, recording)
    return sizes


# -- purge ------------------------------------------------------------------------------------------------
def test_purge_of_many_works_in_slices_and_another_client_is_answered_between(sliced, monkeypatch):
    """Issue 17: "Purging 15.3 M small messages: 9.3 s" (every client waited). Now a
    purge of 1000 takes ten steps of at most 100, and a query from another
    connection, sent at the same time, is answered in the middle of it."""
    harness, _a, ssn_a, _b, ssn_b = two_clients()
    ssn_a.declare_queue("deep")
    fill(harness, ssn_a, "deep", 1000)
    batches = record_batches(monkeypatch)
    purge = ssn_a.command(P.QUEUE_PURGE, "deep")
    probe = ssn_b.command(P.QUEUE_QUERY, "deep")
    harness.run()
    assert ssn_a.results[purge] == {"messages": 1000}
    assert batches == [SLICE] * 10  # nothing joins or copies the whole queue at once (the 4.76 GB peak)
    assert 0 < ssn_b.results[probe]["msgDepth"] < 1000, "the probe waited for the whole purge"
    assert ssn_a.query("deep")["msgDepth"] == 0


def test_purge_takes_the_messages_there_when_it_began_and_no_later_ones(sliced):
    """Decided: a purge removes the messages the queue had when it began; those
    another client sends while it works stay."""
    harness, _a, ssn_a, _b, ssn_b = two_clients()
    ssn_a.declare_queue("q")
    fill(harness, ssn_a, "q", 550)
    purge = ssn_a.command(P.QUEUE_PURGE, "q")
    late = [ssn_b.transfer("q", b"late-%d" % i) for i in range(7)]
    harness.run()
    assert ssn_a.results[purge] == {"messages": 550}
    assert not ssn_b.incomplete(late)
    ssn_b.subscribe("q", "d")
    assert [d.body for d in ssn_b.deliveries] == [b"late-%d" % i for i in range(7)]


def test_later_commands_on_the_purging_connection_wait_for_it(sliced):
    """A connection's commands keep their order: the frames after a long command
    wait until it is done, so a transfer sent after the purge is not purged and
    a query after it sees the queue empty."""
    harness, _a, ssn_a, _b, _ssn_b = two_clients()
    ssn_a.declare_queue("q")
    fill(harness, ssn_a, "q", 1000)
    purge = ssn_a.command(P.QUEUE_PURGE, "q")
    after = ssn_a.transfer("q", b"after")
    query = ssn_a.command(P.QUEUE_QUERY, "q")
    harness.run()
    assert ssn_a.results[purge] == {"messages": 1000}
    assert ssn_a.is_complete(after)
    assert ssn_a.results[query]["msgDepth"] == 1


def test_purge_of_a_flow_stopped_queue_in_slices_releases_every_held_producer(sliced):
    """Issue 17: "10,000 pairs of (a transfer to a flow-stopped queue, a transfer
    to another queue), then a purge: 9.4 s". Every held transfer completes, and
    the session's completion bookkeeping does work in proportion to them (it
    rebuilt the set of completions above the floor at each one)."""
    added = []

    class CountingRangeSet(RangeSet):
        __slots__ = ()

        def add_range(self, first: int, last: int) -> None:
            added.append(first)
            super().add_range(first, last)

    harness = Harness()
    client = harness.connect()
    pairs = 2000
    real = protocol_commands.RangeSet
    protocol_commands.RangeSet = CountingRangeSet
    try:
        ssn = client.session()
        ssn.declare_queue("stop", {"qpid.flow_stop_count": 1, "qpid.flow_resume_count": 0})
        ssn.declare_queue("other")
        ids = []
        for _ in range(pairs):
            ids.append(ssn.transfer("stop", b"held"))
            ssn.transfer("other", b"free")
        harness.run()
        assert len(ssn.incomplete(ids)) == pairs - 1  # the first one set flow on; the rest are held
        del added[:]
        assert ssn.call(P.QUEUE_PURGE, "stop") == {"messages": pairs}
    finally:
        protocol_commands.RangeSet = real
    assert not ssn.incomplete(ids)
    assert ssn.query("other")["msgDepth"] == pairs
    assert len(added) < 10 * pairs, f"{len(added)} ranges added to release {pairs} transfers"


# -- delete and remove-through -------------------------------------------------------------------------------
def test_delete_of_a_deep_queue_lets_go_of_its_messages_in_slices(sliced):
    harness, a, ssn_a, _b, ssn_b = two_clients()
    ssn_a.declare_queue("deep")
    ssn_b.declare_queue("other")
    fill(harness, ssn_a, "deep", 1000)
    entries = harness.broker.queues["deep"].entries
    delete = ssn_a.command(P.QUEUE_DELETE, "deep", False, False)
    a._to_broker()  # the delete's first step: the queue is gone, its first slice let go of
    assert "deep" not in harness.broker.queues
    assert len(entries) == 900
    probe = ssn_b.command(P.QUEUE_QUERY, "other")
    harness.run()
    assert ssn_a.results[delete] == {"messages": 1000}
    assert not entries
    assert ssn_b.results[probe]["msgDepth"] == 0


def test_remove_through_works_in_slices(sliced, monkeypatch):
    harness, _a, ssn_a, _b, _ssn_b = two_clients()
    ssn_a.declare_queue("q")
    fill(harness, ssn_a, "q", 350)
    batches = record_batches(monkeypatch)
    assert ssn_a.call(P.QUEUE_REMOVE_THROUGH, "q", 250) == {"messages": 250}
    assert batches == [100, 100, 50]
    assert ssn_a.query("q")["firstSequence"] == 251


def test_a_long_command_on_a_missing_queue_is_refused_at_once(sliced):
    harness, _a, ssn_a, _b, _ssn_b = two_clients()
    for code, fields in ((P.QUEUE_PURGE, ("nope",)), (P.QUEUE_DELETE, ("nope", False, False)),
                         (P.QUEUE_REMOVE_THROUGH, ("nope", 5))):
        cid = ssn_a.command(code, *fields)
        harness.run()
        assert ssn_a.failures[cid][0] == P.NOT_FOUND and "'nope'" in ssn_a.failures[cid][1]
    assert ssn_a.declare_queue("fine")["created"]


def test_a_connection_closed_during_a_purge_finishes_it(sliced):
    harness, a, ssn_a, _b, ssn_b = two_clients()
    ssn_a.declare_queue("q")
    fill(harness, ssn_a, "q", 1000)
    ssn_a.command(P.QUEUE_PURGE, "q")
    a._to_broker()
    assert a.pump.unfinished is not None
    a.pump.close_sessions()
    assert a.pump.unfinished is None
    assert ssn_b.query("q")["msgDepth"] == 0


# -- queue.remove-sequences and queue.available (the Spark source's commands) ------------------------------
def count_seq_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = queue_module.seq_of

    def seq_of(entry):
        calls[0] += 1
        return real(entry)

    monkeypatch.setattr(queue_module, "seq_of", seq_of)
    return calls


def test_remove_sequences_works_in_slices_and_another_client_is_answered_between(sliced, monkeypatch):
    """queue.remove-sequences of every other message of 1000 looks at 100
    messages per step (ten steps, each dequeuing the 50 named among them),
    and a query from another connection is answered in the middle of it.
    Exactly the messages named go; the others stay, in order."""
    harness, _a, ssn_a, _b, ssn_b = two_clients()
    ssn_a.declare_queue("q")
    fill(harness, ssn_a, "q", 1000)
    incarnation = ssn_a.query("q")["incarnation"]
    odd = RangeSet([(i, i) for i in range(1, 1001, 2)])
    batches = record_batches(monkeypatch)
    reads = count_seq_reads(monkeypatch)
    remove = ssn_a.command(P.QUEUE_REMOVE_SEQUENCES, "q", incarnation, odd.to_wire())
    probe = ssn_b.command(P.QUEUE_QUERY, "q")
    harness.run()
    assert ssn_a.results[remove] == {"messages": 500}
    assert batches == [SLICE // 2] * 10  # each step: the odd half of the hundred it looked at
    assert reads[0] < 20 * 1000, f"{reads[0]} sequence numbers read for 1000 messages"
    assert 500 < ssn_b.results[probe]["msgDepth"] < 1000, "the probe waited for the whole removal"
    monkeypatch.undo()
    assert list(RangeSet.from_wire(ssn_a.call(P.QUEUE_AVAILABLE, "q", 0, -1)["sequences"])) == list(range(2, 1001, 2))


def test_available_works_in_slices_and_another_client_is_answered_between(sliced, monkeypatch):
    """queue.available of all 1000 messages: ten steps of 100, a query from
    another connection answered between two, and the answer whole."""
    harness, a, ssn_a, _b, ssn_b = two_clients()
    ssn_a.declare_queue("q")
    fill(harness, ssn_a, "q", 1000)
    steps = []
    real = queue_module.Queue.available_slice

    def available_slice(self, out, after, limit, most):
        got = real(self, out, after, limit, most)
        steps.append(got[0])
        return got

    monkeypatch.setattr(queue_module.Queue, "available_slice", available_slice)
    available = ssn_a.command(P.QUEUE_AVAILABLE, "q", 0, -1)
    a._to_broker()
    assert a.pump.unfinished is not None and steps == [SLICE]  # the first step only
    probe = ssn_b.command(P.QUEUE_QUERY, "q")
    assert ssn_b.client._to_broker() and ssn_b.client._from_broker()
    assert ssn_b.results[probe]["msgDepth"] == 1000 and available not in ssn_a.results  # answered in between
    harness.run()
    assert steps == [SLICE] * 10 + [0]
    answer = ssn_a.results[available]
    assert list(RangeSet.from_wire(answer["sequences"]).ranges()) == [(1, 1000)]
    # With a limit: exactly that many, in slices too.
    fill(harness, ssn_a, "q", 1000)
    steps.clear()
    answer = ssn_a.call(P.QUEUE_AVAILABLE, "q", 500, 250)
    assert list(RangeSet.from_wire(answer["sequences"]).ranges()) == [(501, 750)] and steps == [100, 100, 50]


def test_remove_sequences_with_more_ranges_than_the_limit_is_refused(monkeypatch):
    """Bound: at most MAX_RANGES ranges in one queue.remove-sequences, as in an
    accept. Past it, RESOURCE_LIMIT_EXCEEDED naming the limit; nothing is
    removed, and the session carries on."""
    monkeypatch.setattr(commands_module, "MAX_RANGES", 50)
    harness = Harness()
    ssn = harness.connect().session()
    ssn.declare_queue("q")
    fill(harness, ssn, "q", 200)
    incarnation = ssn.query("q")["incarnation"]
    wire = RangeSet([(i, i) for i in range(1, 103, 2)]).to_wire()  # 51 ranges
    cid = ssn.command(P.QUEUE_REMOVE_SEQUENCES, "q", incarnation, wire)
    harness.run()
    code, text = ssn.failures[cid]
    assert code == P.RESOURCE_LIMIT_EXCEEDED and "51 ranges" in text and "limit of 50" in text, text
    assert ssn.query("q")["msgDepth"] == 200
    assert ssn.call(P.QUEUE_REMOVE_SEQUENCES, "q", incarnation, wire[:100]) == {"messages": 50}  # the limit: fine


def test_available_answer_of_more_ranges_than_the_limit_is_refused(monkeypatch):
    """Bound: an answer of queue.available holds at most MAX_RANGES ranges
    (every other message acquired by a consumer makes one range each). Past
    it, RESOURCE_LIMIT_EXCEEDED naming the limit and how to ask for fewer;
    with a limit that fits, the same question is answered."""
    monkeypatch.setattr(commands_module, "MAX_RANGES", 50)
    harness = Harness()
    ssn = harness.connect().session()
    ssn.declare_queue("q")
    fill(harness, ssn, "q", 200)
    incarnation = ssn.query("q")["incarnation"]
    ssn.call(P.QUEUE_REMOVE_SEQUENCES, "q", incarnation, RangeSet([(i, i) for i in range(2, 201, 2)]).to_wire()[:100])
    cid = ssn.command(P.QUEUE_AVAILABLE, "q", 0, -1)
    harness.run()
    code, text = ssn.failures[cid]
    assert code == P.RESOURCE_LIMIT_EXCEEDED and "more than 50 ranges" in text and "limit" in text, text
    answer = ssn.call(P.QUEUE_AVAILABLE, "q", 0, 50)
    assert RangeSet.from_wire(answer["sequences"]).range_count == 50


# -- accept and release ranges -----------------------------------------------------------------------------
def explicit_consumer(harness: Harness, ssn: MemorySession, n: int, credit: int = -1) -> None:
    ssn.declare_queue("q")
    ssn.subscribe("q", "d", credit=credit, accept=P.ACCEPT_EXPLICIT)
    fill(harness, ssn, "q", n)
    assert len(ssn.deliveries) == min(n, credit) if credit >= 0 else n


def test_accept_of_ranges_in_descending_order_merges_each_at_the_end(monkeypatch):
    """Issue 17: "One message.accept frame with 80,000 descending ranges (669 KB):
    about 1 s per frame". Each range was inserted at the front of the set;
    now they are sorted first and every one is added at the end."""
    firsts: list[int] = []
    real = RangeSet.add_range

    def add_range(self, first: int, last: int) -> None:
        firsts.append(first)
        real(self, first, last)

    harness = Harness()
    ssn = harness.connect().session()
    explicit_consumer(harness, ssn, 3000)
    wire = [x for i in range(2998, -1, -2) for x in (i, i)]  # every other delivery, newest first
    monkeypatch.setattr(RangeSet, "add_range", add_range)
    ssn.call(P.ACCEPT, wire)
    monkeypatch.undo()
    assert firsts == sorted(firsts)
    assert ssn.query("q")["msgDepth"] == 1500
    ssn.call(P.ACCEPT, [0, 2999])
    assert ssn.query("q")["msgDepth"] == 0


@pytest.mark.parametrize("code", [P.ACCEPT, P.RELEASE])
def test_more_ranges_than_the_limit_in_one_command_are_refused(code):
    """Bound: at most MAX_RANGES (10,000) ranges per message.accept or
    message.release. Past it, RESOURCE_LIMIT_EXCEEDED naming the limit; nothing
    is accepted or released, and the session carries on."""
    limit = commands_module.MAX_RANGES
    harness = Harness()
    ssn = harness.connect(max_frame_size=4 << 20).session()
    explicit_consumer(harness, ssn, 2 * limit + 2)
    wire = [x for i in range(0, 2 * limit + 2, 2) for x in (i, i)]
    cid = ssn.command(code, wire)
    harness.run()
    assert ssn.failures[cid][0] == P.RESOURCE_LIMIT_EXCEEDED
    assert f"{limit + 1} ranges" in ssn.failures[cid][1] and f"limit of {limit}" in ssn.failures[cid][1]
    assert ssn.query("q")["msgDepth"] == 2 * limit + 2
    ssn.call(code, wire[:2 * limit])  # exactly the limit is fine
    ssn.call(P.ACCEPT, [0, 2 * limit + 1])
    assert ssn.query("q")["msgDepth"] == (0 if code == P.ACCEPT else limit)


# -- detach ---------------------------------------------------------------------------------------------
def test_two_sessions_detaching_with_unaccepted_deliveries_merge_them_back_in_one_pass(monkeypatch):
    """Issue 17: "Two sessions each detaching with 10k unaccepted deliveries:
    6.1 s". The second session's deliveries, interleaved with the first's, were
    each put back by a walk along the queue; now they are merged in one pass.
    Every message is back, in order, marked redelivered."""
    n = 2000
    harness = Harness()
    client = harness.connect()
    a, b = client.session("a"), client.session("b")
    a.declare_queue("q")
    a.subscribe("q", "da", credit=n, accept=P.ACCEPT_EXPLICIT)
    b.subscribe("q", "db", credit=n, accept=P.ACCEPT_EXPLICIT)
    fill(harness, a, "q", 2 * n)
    assert [d.sequence for d in a.deliveries[:3]] == [1, 3, 5]
    assert [d.sequence for d in b.deliveries[:3]] == [2, 4, 6]
    calls = [0]
    real = queue_module.seq_of

    def seq_of(entry):
        calls[0] += 1
        return real(entry)

    monkeypatch.setattr(queue_module, "seq_of", seq_of)
    client.protocol.detach(a.channel)
    client.protocol.detach(b.channel)
    harness.run()
    assert calls[0] < 10 * n, f"{calls[0]} sequence numbers read to put back {2 * n} deliveries"
    monkeypatch.undo()
    c = client.session("c")
    c.subscribe("q", "dc")
    assert [d.sequence for d in c.deliveries] == list(range(1, 2 * n + 1))
    assert all(d.redelivered for d in c.deliveries)


def test_accept_of_many_deliveries_in_one_range_works_in_slices(sliced, monkeypatch):
    """One accept of 1000 deliveries: ten dequeues of 100 (each joins its
    entries' bytes), another client answered between two."""
    harness, _a, ssn_a, _b, ssn_b = two_clients()
    explicit_consumer(harness, ssn_a, 1000)
    batches = record_batches(monkeypatch)
    accept = ssn_a.command(P.ACCEPT, [0, 999])
    probe = ssn_b.command(P.QUEUE_QUERY, "q")
    harness.run()
    assert ssn_a.is_complete(accept) and accept not in ssn_a.results and accept not in ssn_a.failures
    assert batches == [SLICE] * 10
    assert 0 < ssn_b.results[probe]["msgDepth"] < 1000
    assert ssn_a.query("q")["msgDepth"] == 0


def test_release_of_many_deliveries_puts_them_back_in_slices_in_order(sliced):
    harness, a, ssn_a, _b, ssn_b = two_clients()
    explicit_consumer(harness, ssn_a, 1000, credit=1000)
    ssn_a.call(P.CANCEL, "d")
    entries = harness.broker.queues["q"].entries
    release = ssn_a.command(P.RELEASE, [0, 999])
    a._to_broker()
    assert a.pump.unfinished is not None and len(entries) == SLICE  # the newest hundred, first
    harness.run()
    assert ssn_a.is_complete(release) and release not in ssn_a.failures
    ssn_b.subscribe("q", "d")
    assert [d.sequence for d in ssn_b.deliveries] == list(range(1, 1001))
    assert all(d.redelivered for d in ssn_b.deliveries)


def test_detach_with_many_unaccepted_deliveries_puts_them_back_in_slices(sliced):
    """Detach: the session's subscriptions end at once, its deliveries go back
    100 per step, the connection's later frames wait for the last, and
    another connection is served between two."""
    harness, a, ssn_a, _b, ssn_b = two_clients()
    explicit_consumer(harness, ssn_a, 1000)
    entries = harness.broker.queues["q"].entries
    a.protocol.detach(ssn_a.channel)
    after = MemorySession(a)
    after.channel = a.protocol.attach("after", after)  # this attach waits behind the detach
    a._to_broker()
    assert a.pump.unfinished is not None and len(entries) == SLICE
    assert not harness.broker.queues["q"].consumers
    probe = ssn_b.command(P.QUEUE_QUERY, "q")
    b_done = ssn_b.client._to_broker() and ssn_b.client._from_broker()
    assert b_done and ssn_b.results[probe]["msgDepth"] == 1000 and len(entries) == SLICE
    harness.run()
    assert a.pump.unfinished is None and len(entries) == 1000
    after.subscribe("q", "d2")
    assert [d.sequence for d in after.deliveries] == list(range(1, 1001))
    assert all(d.redelivered for d in after.deliveries)


def test_a_connections_close_puts_back_its_sessions_deliveries_in_slices(sliced, monkeypatch):
    """A connection closing with two sessions of 1000 unaccepted deliveries
    each (the issue's "two sessions each detaching with 10k unaccepted
    deliveries", on a connection loss): its first step closes both sessions
    (their subscriptions end) and puts back one slice of each; the rest goes
    back 100 at a time, one step each, another connection served between two.
    Every message is back, in order, marked redelivered."""
    harness, a, ssn_a, _b, ssn_b = two_clients()
    ssn_a2 = MemorySession(a)
    ssn_a2.channel = a.protocol.attach("a2", ssn_a2)
    ssn_a.declare_queue("q")
    ssn_a.subscribe("q", "d1", credit=1000, accept=P.ACCEPT_EXPLICIT)
    ssn_a2.subscribe("q", "d2", credit=1000, accept=P.ACCEPT_EXPLICIT)
    fill(harness, ssn_b, "q", 2000)
    assert len(ssn_a.deliveries) == len(ssn_a2.deliveries) == 1000
    sizes = record_batches(monkeypatch, "put_back_many")
    q = harness.broker.queues["q"]
    steps = a.pump.close_steps()
    next(steps)
    assert sizes == [SLICE, SLICE] and len(q.entries) == 2 * SLICE
    assert not q.consumers  # both sessions closed at the first step: nothing is delivered to them any more
    probe = ssn_b.command(P.QUEUE_QUERY, "q")
    assert ssn_b.client._to_broker() and ssn_b.client._from_broker()
    assert ssn_b.results[probe]["msgDepth"] == 2000 and len(q.entries) == 2 * SLICE  # answered in between
    done = len(sizes)
    for _ in steps:
        assert len(sizes) - done <= 1, "more than one slice in a step"
        done = len(sizes)
    assert sizes == [SLICE] * 20
    ssn_b.subscribe("q", "d")
    assert [d.sequence for d in ssn_b.deliveries] == list(range(1, 2001))
    assert all(d.redelivered for d in ssn_b.deliveries)


# -- execution.sync -------------------------------------------------------------------------------------
def test_syncs_past_the_limit_are_refused_and_the_rest_complete_on_release(monkeypatch):
    """Issue 17: "400k execution.sync queued behind one held transfer, then
    released: 10.6 s". Bound: at most MAX_WAITING_SYNCS (1000) syncs of one
    session wait at a time; one more is refused with RESOURCE_LIMIT_EXCEEDED
    naming the limit, and those waiting complete when the transfer does."""
    limit = commands_module.MAX_WAITING_SYNCS
    harness = Harness()
    client = harness.connect()
    ssn = client.session()
    ssn.declare_queue("stop", {"qpid.flow_stop_count": 1, "qpid.flow_resume_count": 0})
    ssn.transfer("stop", b"first")
    held = ssn.transfer("stop", b"held")
    syncs = [ssn.command(P.SYNC) for _ in range(limit + 1)]
    harness.run()
    assert not ssn.is_complete(held)
    assert ssn.incomplete(syncs) == syncs[:limit]
    code, text = ssn.failures[syncs[limit]]
    assert code == P.RESOURCE_LIMIT_EXCEEDED and f"the limit is {limit}" in text
    other = client.session("other")
    assert other.call(P.SYNC) is None  # another session is not affected
    assert ssn.call(P.QUEUE_PURGE, "stop") == {"messages": 2}
    assert not ssn.incomplete([held, *syncs])
    assert ssn.call(P.SYNC) is None  # and this one works again


# -- subscriptions per session ----------------------------------------------------------------------------------
def test_subscriptions_past_the_limit_are_refused_naming_it():
    """50,000 subscriptions on one session in one write took 1.7 s and starved
    every other client. Bound: at most MAX_CONSUMERS (1000) per session; one
    more is refused with RESOURCE_LIMIT_EXCEEDED naming the limit, and the
    session (and every other) goes on working."""
    limit = broker_module.MAX_CONSUMERS
    harness = Harness()
    client = harness.connect()
    ssn = client.session()
    ssn.declare_queue("q")
    subscribes = [ssn.command(P.SUBSCRIBE, "q", f"d{i}", P.ACCEPT_EXPLICIT, 0, 0) for i in range(limit + 1)]
    harness.run()
    assert not ssn.incomplete(subscribes)
    assert [cid for cid in subscribes if cid in ssn.failures] == [subscribes[limit]]
    code, text = ssn.failures[subscribes[limit]]
    assert code == P.RESOURCE_LIMIT_EXCEEDED and f"holds {limit} subscriptions" in text
    ssn.call(P.CANCEL, "d0")
    ssn.call(P.SUBSCRIBE, "q", "again", P.ACCEPT_EXPLICIT, 0, 0)  # room again after a cancel
    assert client.session("other").call(P.SUBSCRIBE, "q", "d0", P.ACCEPT_EXPLICIT, 0, 0) is None


# -- over loopback, through the real server and client ----------------------------------------------------
async def test_a_client_is_answered_while_another_purges_a_deep_queue(running, monkeypatch):
    """The purge freeze end to end: a probe on another connection does round
    trips while a purge of 20,000 messages runs in 100 steps; some of its
    answers come in the middle (0 < depth < 20,000), and nothing but the
    purged messages is lost."""
    monkeypatch.setattr(broker_module, "SLICE", 200)
    n = 20_000
    async with qflow.open_connection(running.host, running.port) as purger, \
            qflow.open_connection(running.host, running.port) as prober:
        ssn = await purger.session()
        probe = await prober.session()
        await ssn.declare_queue("deep")
        await ssn.declare_queue("kept")
        sender = ssn.sender("deep", capacity=5000)
        for i in range(n):
            await sender.send(b"%d" % i)
        await sender.sync()
        kept = probe.sender("kept", capacity=10)
        depths: list[int] = []
        purged: list[dict] = []

        async def purge() -> None:
            purged.append(await ssn.purge_queue("deep"))

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(purge)
                while not purged:
                    depths.append((await probe.query_queue("deep"))["msgDepth"])
                    await kept.send(b"k")
        await kept.sync()
        assert purged == [{"messages": n}]
        assert any(0 < d < n for d in depths), f"no answer during the purge: {sorted(set(depths))[:5]}..."
        assert (await probe.query_queue("kept"))["msgDepth"] == len(depths)
        assert (await probe.query_queue("deep"))["msgDepth"] == 0


@pytest.mark.parametrize("method, path, answer", [
    ("POST", "/api/queues/deep/purge", {"queue": "deep", "purged": 20_000}),
    ("DELETE", "/api/queues/deep", {"queue": "deep", "deleted": True, "messages": 20_000}),
])
async def test_a_client_is_answered_while_the_management_api_purges_or_deletes(nursery, monkeypatch, method, path,
                                                                              answer):
    """The management API's purge and delete work in the same steps, the
    HTTP server yielding between two: a probe's round trips are answered
    in the middle."""
    from qflow.management import ManagementApi, ManagementServer
    from tests.conftest import start_broker
    from tests.test_management import http

    monkeypatch.setattr(broker_module, "SLICE", 200)
    n = 20_000
    running = await start_broker(nursery)
    server = ManagementServer(ManagementApi(running.broker, running.server))
    mgmt_port = await nursery.start(server.serve, "127.0.0.1", 0)
    async with qflow.open_connection(running.host, running.port) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("deep")
        await ssn.declare_queue("other")
        sender = ssn.sender("deep", capacity=5000)
        for i in range(n):
            await sender.send(b"%d" % i)
        await sender.sync()
        answers: list = []
        seen_mid = False
        entries = running.broker.queues["deep"].entries  # what the purge or delete works through

        async def manage() -> None:
            answers.append(await http(mgmt_port, method, path))

        with trio.fail_after(60):
            async with trio.open_nursery() as inner:
                inner.start_soon(manage)
                while not answers:
                    await ssn.query_queue("other")
                    seen_mid |= 0 < len(entries) < n  # answered with the work half done
        assert answers == [(200, answer)]
        assert seen_mid, "the probe was never answered while the request worked"
        assert (await ssn.query_queue("other"))["msgDepth"] == 0


async def test_a_long_command_does_not_count_against_its_own_connections_heartbeat(mock_clock, monkeypatch):
    """While a long command runs, its connection's later frames (its heartbeats
    among them) wait unread: that time is not the peer's silence. Here each
    step of a purge takes a mock second, ten in all, under heartbeat=1 (a
    silent peer is dropped after 2 s): the connection survives and is answered."""
    import msgpack
    import trio.testing

    from qflow.broker import Broker
    from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, PROTOCOL_HEADER
    from qflow.server import Connection

    monkeypatch.setattr(broker_module, "SLICE", 100)
    real_step = commands_module.Unfinished.step

    def slow_step(self, broker):
        mock_clock.jump(1)
        return real_step(self, broker)

    monkeypatch.setattr(commands_module.Unfinished, "step", slow_step)
    client, server_end = trio.testing.memory_stream_pair()
    conn = Connection(Broker(), server_end, DEFAULT_MAX_FRAME_SIZE, "memory")
    frames = [[P.OPEN, {"heartbeat": 1}], [P.ATTACH, 0, "s"], [P.QUEUE_DECLARE, 0, "q", False, False, False, {}, False]]
    frames += [[P.TRANSFER, 0, "", "q", None, b"x"] for _ in range(1000)]
    frames += [[P.QUEUE_PURGE, 0, "q"], [P.QUEUE_QUERY, 0, "q"], [P.HEARTBEAT]]
    await client.send_all(PROTOCOL_HEADER + b"".join(msgpack.packb(f, use_bin_type=True) for f in frames))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        results = {}

        async def until_result(cid: int) -> None:
            with trio.fail_after(30):
                while cid not in results:
                    data = await client.receive_some(65536)
                    assert data, "the connection ended"
                    unpacker.feed(data)
                    for frame in unpacker:
                        assert frame[0] != P.CLOSE, frame
                        if frame[0] == P.RESULT:
                            results[frame[2]] = frame[3]

        await until_result(1002)
        assert results[1001] == {"messages": 1000} and results[1002]["msgDepth"] == 0
        await client.send_all(msgpack.packb([P.QUEUE_QUERY, 0, "q"]))  # the connection is still served
        await until_result(1003)
        await client.aclose()
