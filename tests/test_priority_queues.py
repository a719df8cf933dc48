"""Priority queues (qpidd's ``qpid.priorities``, RabbitMQ's ``x-max-priority``):
delivery takes the highest level first, FIFO within a level; a message's
priority (0-9) maps to a level as qpidd maps it. Through the in-memory harness,
with transfers taken in runs (C) and frame by frame."""

from __future__ import annotations

import pytest

from qflow import protocol as P
from qflow.broker.broker import finish
from qflow.broker.settings import priority_levels
from qflow.protocol.entries import encode_tail, message_size, new_entry
from qflow.testing import Harness, MemorySession


@pytest.fixture(params=[True, False], ids=["runs", "frames"])
def harness(request) -> Harness:
    return Harness(transfer_runs=request.param)


def send(h: Harness, ssn: MemorySession, queue: str, priorities: list[int | None]) -> list[int]:
    ids = [ssn.transfer(queue, b"%s-%d" % (str(p).encode(), i), "", None if p is None else {"priority": p})
           for i, p in enumerate(priorities)]
    h.run()
    return ids


def receive(h: Harness, ssn: MemorySession, queue: str, credit: int = -1) -> list[bytes]:
    before = len(ssn.deliveries)
    destination = f"r{before}"
    ssn.subscribe(queue, destination, credit=credit)
    ssn.call(P.CANCEL, destination)
    return [d.body for d in ssn.deliveries[before:]]


def test_qpidd_mapping_of_priorities_to_levels() -> None:
    """AMQP 0-10's priority-level-implementation, as qpidd's PriorityQueue: levels centred on 5."""
    assert priority_levels(10) == tuple(range(10))
    assert priority_levels(2) == (0, 0, 0, 0, 0, 1, 1, 1, 1, 1)
    assert priority_levels(3) == (0, 0, 0, 0, 1, 2, 2, 2, 2, 2)
    assert priority_levels(5) == (0, 0, 0, 1, 2, 3, 4, 4, 4, 4)
    assert priority_levels(1) == (0,) * 10


def test_highest_level_first_fifo_within_a_level(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.priorities": 10})
    send(harness, p, "q", [1, 9, None, 5, 9, 0, 4])
    assert receive(harness, p, "q") == [b"9-1", b"9-4", b"5-3", b"None-2", b"4-6", b"1-0", b"0-5"]


def test_two_levels_as_qpidd(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.priorities": 2})
    send(harness, p, "q", [4, 5, 0, 9, None])  # 0-4 low, 5-9 high; none is 4
    assert receive(harness, p, "q") == [b"5-1", b"9-3", b"4-0", b"0-2", b"None-4"]


def test_x_max_priority_as_rabbitmq(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q", {"x-max-priority": 3})
    send(harness, p, "q", [None, 9, 2, 3, 1])  # 3 and above share the top; none is 0
    assert receive(harness, p, "q") == [b"9-1", b"3-3", b"2-2", b"1-4", b"None-0"]


def test_without_levels_a_priority_changes_nothing(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q")
    send(harness, p, "q", [1, 9, 5])
    assert receive(harness, p, "q") == [b"1-0", b"9-1", b"5-2"]


def test_released_messages_go_back_to_their_level_in_order(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.priorities": 10})
    send(harness, p, "q", [9, 9, 1])
    c = harness.connect().session()
    c.subscribe("q", "c", credit=2, accept=P.ACCEPT_EXPLICIT)
    assert [d.body for d in c.deliveries] == [b"9-0", b"9-1"]
    send(harness, p, "q", [9])
    c.call(P.RELEASE, [c.deliveries[0].delivery_id, c.deliveries[1].delivery_id])
    assert receive(harness, p, "q") == [b"9-0", b"9-1", b"9-0", b"1-2"]


def test_browse_available_purge_and_sequences(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.priorities": 10})
    send(harness, p, "q", [1, 9, 5, 9])
    assert p.call(P.QUEUE_AVAILABLE, "q", 0, -1)["sequences"] == [1, 4]
    assert p.call(P.QUEUE_AVAILABLE, "q", 1, 2)["sequences"] == [2, 3]
    b = harness.connect().session()
    b.call(P.SUBSCRIBE, "q", "b", P.ACCEPT_NONE, P.ACQUIRE_NOT_ACQUIRED, 0)
    b.call(P.FLOW, "b", -1, -1)
    assert [d.sequence for d in b.deliveries] == [1, 2, 3, 4]  # a browser goes by sequence
    assert p.query("q")["firstSequence"] == 1
    p.call(P.QUEUE_REMOVE_THROUGH, "q", 2)
    assert p.query("q")["msgDepth"] == 2 and p.query("q")["firstSequence"] == 3
    p.call(P.QUEUE_PURGE, "q")
    assert p.query("q")["msgDepth"] == 0


def test_a_ring_priority_queue_drops_the_oldest_of_the_lowest_level(harness: Harness) -> None:
    p = harness.connect().session()
    p.declare_queue("q", {"qpid.priorities": 10, "qpid.policy_type": "ring", "qpid.max_count": 3})
    send(harness, p, "q", [9, 1, 5, 1, 9])
    assert receive(harness, p, "q") == [b"9-0", b"9-4", b"5-2"]


def test_dequeues_from_a_priority_queue_release_held_producers(harness: Harness) -> None:
    """A priority queue's flow control is the same: the highest-priority messages
    delivered first are dequeues like any other, releasing its producers."""
    p = harness.connect("producer").session()
    p.declare_queue("q", {"qpid.priorities": 10, "qpid.max_count": 100, "qpid.flow_stop_count": 3,
                          "qpid.flow_resume_count": 3})
    ids = send(harness, p, "q", [1, 2, 3, 9])
    assert p.incomplete(ids) == ids[3:] and p.query("q")["flowStopped"]
    c = harness.connect().session()
    # The held transfer's message has the highest priority: delivered first, its dequeue releases
    # the transfer it belongs to (as any dequeue of a held message does), though flow stays on.
    assert receive(harness, c, "q", credit=1) == [b"9-3"]
    assert not p.incomplete(ids) and p.query("q")["flowStopped"]
    held = send(harness, p, "q", [9])
    assert p.incomplete(held) == held
    assert receive(harness, c, "q", credit=2) == [b"9-0", b"3-2"]  # 2 left: below the resume count
    assert not p.incomplete(held) and not p.query("q")["flowStopped"]


def test_a_priority_survives_recovery() -> None:
    h = Harness()
    p = h.connect().session()
    p.declare_queue("q", {"qpid.priorities": 10})
    tails = [(encode_tail("", "q", {"priority": pr, "durable": True}, b"%d" % pr), 1) for pr in (2, 8, 5)]
    h.broker.queues["q"].restore([new_entry(i + 1, message_size(len(t), n), t) for i, (t, n) in enumerate(tails)])
    h.broker.flush()
    assert receive(h, p, "q") == [b"8", b"5", b"2"]


def test_the_levels_are_fixed_and_checked() -> None:
    h = Harness()
    p = h.connect().session()
    p.declare_queue("q", {"qpid.priorities": 3})
    cid = p.command(P.QUEUE_MODIFY, "q", {"qpid.priorities": 5})
    h.run()
    assert "priority levels are fixed" in p.failures[cid][1]
    for arguments, words in (({"qpid.priorities": 11}, "qpid.priorities must be between 0 and 10"),
                             ({"qpid.priorities": 3, "x-max-priority": 3}, "give one"),
                             ({"qpid.priorities": 3, "x-qpid-priorities": 4}, "differ")):
        p = h.connect().session()
        cid = p.command(P.QUEUE_DECLARE, "bad", False, False, False, arguments, False)
        h.run()
        assert p.failures[cid][0] == P.INVALID_ARGUMENT and words in p.failures[cid][1], p.failures[cid]
    assert finish(h.broker.expire_steps()) == 0
