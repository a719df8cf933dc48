"""The Qpid C++ manual's flow-control examples, run deterministically through
the in-memory harness (qflow.testing.Harness): the same protocol core,
ConnectionPump and broker as qflowd, no sockets and no timing. Every example
runs twice: with the broker taking transfers in runs (C) and frame by frame.
tests/test_flow.py runs the same rules over real sockets."""

from __future__ import annotations

import time

import msgpack
import pytest

from qflow import protocol as P
from qflow.broker import Broker
from qflow.broker.settings import FlowDefaults
from qflow.management.views import queue_view, session_view
from qflow.testing import Harness, MemorySession


@pytest.fixture(params=[True, False], ids=["runs", "frames"])
def harness(request) -> Harness:
    return Harness(transfer_runs=request.param)


def send(h: Harness, ssn: MemorySession, queue: str, n: int, body: bytes = b"x") -> list[int]:
    ids = [ssn.transfer(queue, body) for _ in range(n)]
    h.run()
    return ids


def drain(h: Harness, ssn: MemorySession, queue: str, n: int) -> None:
    """Consume exactly ``n`` messages of ``queue`` (accept mode none: each leaves the queue at delivery)."""
    destination = f"drain-{len(ssn.deliveries)}-{n}"
    ssn.subscribe(queue, destination, credit=n)
    ssn.call(P.CANCEL, destination)


def stopped(ssn: MemorySession, queue: str) -> bool:
    return ssn.query(queue)["flowStopped"]


def test_count_example_900_stop_500_resume(harness: Harness):
    """"a queue with a maximum message count of 1000 ... a Flow Stop Threshold of 900
    messages, and a Flow Resume Threshold of 500 ... When the total number of enqueued
    messages is greater than 900, the queue's flow control state transitions to "ON" ...
    [it] remains "ON" until the total number of enqueued messages is less than 500.\""""
    p = harness.connect("producer").session()
    p.declare_queue("q", {"qpid.max_count": 1000, "qpid.flow_stop_count": 900, "qpid.flow_resume_count": 500})
    first = send(harness, p, "q", 900)
    assert not stopped(p, "q") and not p.incomplete(first)
    held = send(harness, p, "q", 1)  # the 901st
    assert stopped(p, "q") and p.incomplete(held) == held and p.held_by == {"q"}
    c = harness.connect("consumer").session()
    drain(harness, c, "q", 401)  # 500 left: not less than 500
    assert stopped(p, "q") and p.incomplete(held) == held
    drain(harness, c, "q", 1)  # 499
    assert not stopped(p, "q") and not p.incomplete(held) and p.held_by == set()


def test_combined_example_either_stops_both_must_resume(harness: Harness):
    """"Flow control is "ON" when either stop threshold value is crossed" and "remains
    "ON" until both resume thresholds are satisfied": 4000 messages or 8K bytes to
    stop, fewer than 3000 and less than 6K bytes to resume."""
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.max_count": 5000, "qpid.max_size": 10240, "qpid.flow_stop_count": 4000,
                          "qpid.flow_resume_count": 3000, "qpid.flow_stop_size": 8192,
                          "qpid.flow_resume_size": 6144})
    # A message's size is 4 bytes ("" 1, "q" 2, nil properties 1) plus its body's length.
    send(harness, p, "q", 8, body=b"k" * 1020)  # 8 messages of 1024: 8192 bytes, not above 8K
    assert not stopped(p, "q")
    held = send(harness, p, "q", 1, body=b"")  # 8196 bytes: an empty body crosses the size threshold
    assert stopped(p, "q") and p.incomplete(held) == held
    c = harness.connect().session()
    drain(harness, c, "q", 2)  # 7 messages (< 3000) but 6148 bytes: not below 6K yet
    assert stopped(p, "q")
    drain(harness, c, "q", 1)  # 5124 bytes
    assert not stopped(p, "q") and not p.incomplete(held)


def test_capacity_example_c1_50_c2_15_stop_100_at_most_165(harness: Harness):
    """"assume client C1 has a configured capacity of 50 messages, and client C2's
    capacity is 15 messages ... If the queue's flow stop threshold is set to 100
    messages, then, worst-case, the queue may receive up to 165 messages before
    clients C1 and C2 are blocked from sending further messages.\""""
    c1, c2 = harness.connect("C1").session(), harness.connect("C2").session()
    c1.declare_queue("q", {"qpid.flow_stop_count": 100, "qpid.max_size": 0})
    windows = {id(c1): (c1, 50, []), id(c2): (c2, 15, [])}
    for _ in range(1000):  # each producer sends while fewer than its capacity are incomplete
        for ssn, capacity, sent in windows.values():
            while len(ssn.incomplete(sent)) < capacity:
                sent.append(ssn.transfer("q", b"m"))
        harness.run()
    assert c1.query("q")["msgDepth"] == 165
    assert [len(ssn.incomplete(sent)) for ssn, _, sent in windows.values()] == [50, 15]


def test_fanout_completes_only_when_every_destination_has_released(harness: Harness):
    """"delaying the completion of the Message.Transfer command ... until flow control
    state transitions to OFF for all queues that are a destination for that command.\""""
    p = harness.connect().session()
    p.declare_queue("stopped", {"qpid.flow_stop_count": 1, "qpid.flow_resume_count": 1})
    p.declare_queue("open")
    p.call(P.EXCHANGE_DECLARE, "fan", "fanout", False, False)
    p.call(P.EXCHANGE_BIND, "fan", "stopped", "")
    p.call(P.EXCHANGE_BIND, "fan", "open", "")
    first = p.transfer("", b"1", exchange="fan")
    second = p.transfer("", b"2", exchange="fan")  # 2 on "stopped": above 1
    harness.run()
    assert p.is_complete(first) and not p.is_complete(second)
    c = harness.connect().session()
    drain(harness, c, "open", 2)  # the other destination has nothing to do with it
    assert not p.is_complete(second)
    drain(harness, c, "stopped", 2)
    assert p.is_complete(second)


def test_a_held_message_dequeued_while_flow_is_on_is_released_alone(harness: Harness):
    """As qpidd's QueueFlowLimit::dequeued: "even if flow controlled, we must release
    this msg as it is being dequeued"; the others stay held."""
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
    free = send(harness, p, "q", 2)
    held = send(harness, p, "q", 3)
    assert p.incomplete(free + held) == held
    c = harness.connect().session()
    drain(harness, c, "q", 3)  # the two free ones and the first held one: 2 left, not below 1: still on
    assert stopped(p, "q") and p.incomplete(held) == held[1:]


def test_deleting_a_queue_releases_its_held_transfers(harness: Harness):
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.flow_stop_count": 1})
    held = send(harness, p, "q", 3)[1:]
    assert p.incomplete(held) == held
    harness.connect().session().call(P.QUEUE_DELETE, "q", False, False)
    assert not p.incomplete(held)


def test_zero_stop_thresholds_disable_flow_control(harness: Harness):
    """"The user may disable flow control on a per queue basis by setting the
    flow-stop-size and flow-stop-count to zero for the queue.\""""
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.max_count": 100, "qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0})
    ids = send(harness, p, "q", 100)
    assert not p.incomplete(ids) and not stopped(p, "q")


def test_ring_queues_never_hold_producers(harness: Harness):
    """"Queues that have been configured with a Limit Policy of type RING or
    RING-STRICT do NOT have queue flow thresholds enabled.\""""
    p = harness.connect().session()
    p.declare_queue("ring", {"qpid.max_count": 10, "qpid.policy_type": "ring", "qpid.flow_stop_count": 5})
    ids = send(harness, p, "ring", 50)
    assert not p.incomplete(ids)
    stats = p.query("ring")
    assert (stats["msgDepth"], stats["discardsRing"], stats["flowStopped"]) == (10, 40, False)


def test_default_thresholds_are_percentages_of_the_maximum():
    """"setting the flow stop threshold to 90% of the maximum capacity and the flow
    resume threshold to 75% ... 90% of 10000 = 9000 bytes and ... 75% of 10000 = 7500.\""""
    h = Harness(FlowDefaults(90, 75, 0))
    p = h.connect().session()
    stats = p.declare_queue("q", {"qpid.max_size": 10000}) and p.query("q")
    assert (stats["flowStopSize"], stats["flowResumeSize"]) == (9000, 7500)


def test_release_notices_go_out_in_the_order_the_sessions_were_held(harness: Harness):
    """Deterministic output: when a queue resumes, the sessions it held are told in
    the order they were held (the broker once kept them in a set, whose order
    followed object addresses; test_runs_change_nothing_but_speed caught it)."""
    client = harness.connect()
    sessions = [client.session(f"s{i}") for i in range(6)]
    sessions[0].declare_queue("q", {"qpid.flow_stop_count": 1, "qpid.flow_resume_count": 1})
    order = [3, 0, 5, 1, 4, 2]
    for i in order:
        send(harness, sessions[i], "q", 2 if i == order[0] else 1)
    assert all(s.held_by == {"q"} for s in sessions)
    held = [ch for ch, _, on in client.flow_notices if on]
    sessions[0].call(P.QUEUE_MODIFY, "q", {"qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0})  # flow off
    released = [ch for ch, _, on in client.flow_notices if not on]
    assert held == released == [sessions[i].channel for i in order]


# -- which sessions are held, and by which queue (issue 13) ------------------------------------------------------


def held_view(h: Harness, ssn: MemorySession) -> list[str]:
    """The queues that hold ``ssn`` as management shows them (/api/connections, qflow-stat -c)."""
    view = session_view(h.broker, ssn.client.pump.sessions[ssn.channel], time.time())
    assert view["flowStopped"] == bool(view["heldBy"])
    return [held["queue"] for held in view["heldBy"]]


def notices(ssn: MemorySession) -> list[tuple[str, bool]]:
    return [(queue, held) for channel, queue, held in ssn.client.flow_notices if channel == ssn.channel]


def test_a_session_leaves_the_held_view_when_its_held_transfer_is_released_on_its_own(harness: Harness):
    """"A session appears as held (in /api/connections, qflow-stat -c and the client's
    held_by) only while it still has a transfer held. Once its held transfer is
    released on its own (its message was consumed while the flow stayed on), it
    leaves the view." Stop above 2, resume below 1: A's third message and B's one are
    held; consuming the first three lets A's go while the flow stays on for B's."""
    a, b = harness.connect("A").session(), harness.connect("B").session()
    a.declare_queue("q", {"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
    send(harness, a, "q", 2)
    a_held, b_held = send(harness, a, "q", 1), send(harness, b, "q", 1)
    assert a.held_by == b.held_by == {"q"} and held_view(harness, a) == held_view(harness, b) == ["q"]
    assert queue_view(harness.broker, harness.broker.queues["q"])["heldSessionCount"] == 2

    c = harness.connect().session()
    drain(harness, c, "q", 3)  # 1 left: not below 1, the flow stays on; A's held message was among the 3
    assert stopped(a, "q") and not a.incomplete(a_held) and b.incomplete(b_held) == b_held
    assert a.held_by == set() and held_view(harness, a) == [] and notices(a) == [("q", True), ("q", False)]
    assert b.held_by == {"q"} and held_view(harness, b) == ["q"] and notices(b) == [("q", True)]
    assert queue_view(harness.broker, harness.broker.queues["q"])["heldSessionCount"] == 1

    drain(harness, c, "q", 1)  # 0 < 1: the flow turns off and lets B go too
    assert not stopped(a, "q") and not b.incomplete(b_held)
    assert b.held_by == set() and held_view(harness, b) == [] and notices(b) == [("q", True), ("q", False)]
    assert notices(a) == [("q", True), ("q", False)]  # told once, not again at the resume


def test_a_session_stays_held_while_any_of_its_transfers_is(harness: Harness):
    """A has two held transfers: the first consumed, it is still held by the second."""
    a, b = harness.connect("A").session(), harness.connect("B").session()
    a.declare_queue("q", {"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
    send(harness, a, "q", 2)
    a_held, b_held = send(harness, a, "q", 2), send(harness, b, "q", 1)
    c = harness.connect().session()
    drain(harness, c, "q", 3)
    assert a.incomplete(a_held) == a_held[1:] and a.held_by == {"q"} and held_view(harness, a) == ["q"]
    assert notices(a) == [("q", True)]
    drain(harness, c, "q", 1)  # A's last held one; B's keeps the flow on
    assert stopped(a, "q") and not a.incomplete(a_held) and b.incomplete(b_held) == b_held
    assert a.held_by == set() and held_view(harness, a) == [] and notices(a) == [("q", True), ("q", False)]


def test_held_again_after_leaving_the_view_and_after_a_resume(harness: Harness):
    """The view follows each hold: A leaves it while the flow is on, is held again by
    its next transfer (the flow is still on), and, after a resume and a new stop, is
    held and let go the same way (the holds of the new stop are told apart from the
    old ones: tests the broker's tokens after a resume)."""
    a, b = harness.connect("A").session(), harness.connect("B").session()
    a.declare_queue("q", {"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
    send(harness, a, "q", 2)
    send(harness, a, "q", 1)
    send(harness, b, "q", 1)
    c = harness.connect().session()
    drain(harness, c, "q", 3)
    assert a.held_by == set()
    again = send(harness, a, "q", 1)  # flow still on: held at once
    assert a.incomplete(again) == again and a.held_by == {"q"} and held_view(harness, a) == ["q"]
    assert notices(a) == [("q", True), ("q", False), ("q", True)]
    drain(harness, c, "q", 2)  # B's and A's: 0 left, the flow resumes
    assert not stopped(a, "q") and a.held_by == b.held_by == set()
    assert notices(a) == [("q", True), ("q", False)] * 2

    send(harness, a, "q", 2)  # the second stop
    second = send(harness, a, "q", 1)
    b_second = send(harness, b, "q", 1)
    assert a.held_by == b.held_by == {"q"} and a.query("q")["flowStoppedCount"] == 2
    drain(harness, c, "q", 3)
    assert not a.incomplete(second) and a.held_by == set() and held_view(harness, a) == []
    assert b.incomplete(b_second) == b_second and b.held_by == {"q"} and held_view(harness, b) == ["q"]


def test_a_transfer_held_and_let_go_in_one_batch_is_never_shown_held():
    """docs/protocol.md: "A transfer held and let go within the same batch of input
    gets neither [notice]". Driven through the broker's own calls: one batch in which
    the second message stops the flow (and is held), then both are dequeued and the
    flow resumes, before the batch ends; the session is told nothing and held by nothing."""
    broker = Broker()
    ssn = broker.open_session(0, "p")
    q, _ = broker.declare_queue("q", arguments={"qpid.flow_stop_count": 1, "qpid.flow_resume_count": 1})
    for body in (b"1", b"2"):
        broker.transfer(ssn, ssn.commands.receive(), "", "q", None, body)
    q.dequeue(q.entries.popleft())
    q.dequeue(q.entries.popleft())
    broker.flush()
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(ssn.out.take())
    frames = list(unpacker)
    assert [f[0] for f in frames] == [P.COMPLETED] and frames[0][2] == [0, 1]
    assert broker.completion.held_sessions(q) == {} and broker.completion.held_tokens(q) == {} and ssn.held_since == {}
    assert broker.queue_stats(q)["flowStoppedCount"] == 1
