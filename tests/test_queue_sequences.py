"""queue.available and queue.remove-sequences: what a browsing reader (the
Spark source) plans by sequence number, and its commit, which removes exactly
the messages it read and nothing else; the queue's incarnation, which tells a
queue deleted and declared again from the one whose numbers a reader holds."""

from __future__ import annotations

import pytest
import trio

import qflow
from qflow import protocol as P
from qflow.protocol.ranges import RangeSet
from tests.conftest import wait_for


async def fill(ssn: qflow.Session, queue: str, n: int, **arguments: int) -> None:
    await ssn.declare_queue(queue, arguments=arguments or None)
    sender = ssn.sender(queue, capacity=100)
    for i in range(n):
        await sender.send(b"m%d" % i)
    await sender.sync()


async def test_available_lists_sequences_above_after_up_to_limit(ssn):
    await fill(ssn, "q", 10)
    a = await ssn.available("q")
    assert list(a["sequences"].ranges()) == [(1, 10)]
    assert (a["firstSequence"], a["lastSequence"]) == (1, 10)
    assert a["incarnation"] == (await ssn.query_queue("q"))["incarnation"]
    assert list((await ssn.available("q", after=3, limit=4))["sequences"].ranges()) == [(4, 7)]
    assert not (await ssn.available("q", after=10))["sequences"]
    assert not (await ssn.available("q", after=2, limit=0))["sequences"]


async def test_available_leaves_out_messages_another_consumer_holds(ssn):
    await fill(ssn, "q", 6)
    receiver = await ssn.receiver("q", capacity=2, accept="explicit")  # acquires 1 and 2, unaccepted
    await wait_for(lambda: receiver.available() == 2)  # delivered; not fetched, so no credit renewed
    assert list((await ssn.available("q"))["sequences"].ranges()) == [(3, 6)]
    assert (await ssn.query_queue("q"))["msgDepth"] == 6  # still there, only not available
    assert [(await receiver.fetch(timeout=10)).sequence for _ in range(2)] == [1, 2]


async def test_remove_sequences_removes_exactly_those_and_keeps_the_rest(ssn):
    """Sequences 2-4 and 7 go; 1, 5, 6, 8 stay in their order; a sequence
    already gone (or never there) is no error."""
    await fill(ssn, "q", 8)
    incarnation = (await ssn.query_queue("q"))["incarnation"]
    assert await ssn.remove_sequences("q", incarnation, RangeSet([(2, 4), (7, 7), (50, 60)])) == 4
    assert list((await ssn.available("q"))["sequences"]) == [1, 5, 6, 8]
    assert (await ssn.query_queue("q"))["msgDepth"] == 4
    assert await ssn.remove_sequences("q", incarnation, RangeSet([(2, 4)])) == 0  # idempotent
    receiver = await ssn.receiver("q")
    assert [(await receiver.fetch(timeout=10)).body for _ in range(4)] == [b"m0", b"m4", b"m5", b"m7"]


async def test_remove_sequences_of_another_incarnation_is_refused_and_removes_nothing(ssn):
    """A queue deleted and declared again numbers from 1 again: a commit of
    the old queue's numbers must not remove the new queue's messages."""
    await fill(ssn, "q", 5)
    old = (await ssn.query_queue("q"))["incarnation"]
    await ssn.delete_queue("q")
    await fill(ssn, "q", 5)
    new = (await ssn.query_queue("q"))["incarnation"]
    assert new != old
    with pytest.raises(qflow.PreconditionFailed, match=f"queue 'q' is incarnation {new}, not {old}"):
        await ssn.remove_sequences("q", old, RangeSet([(1, 5)]))
    assert (await ssn.query_queue("q"))["msgDepth"] == 5
    with pytest.raises(qflow.NotFound, match="queue.remove-sequences: queue 'nope' not found"):
        await ssn.remove_sequences("nope", new, RangeSet([(1, 1)]))


async def test_bad_arguments_are_refused_naming_the_fault(running):
    conn = await running.connect()
    ssn = await conn.session()
    await fill(ssn, "q", 2)
    with pytest.raises(qflow.InvalidArgument, match="limit >= -1"):
        await ssn.available("q", after=0, limit=-2)
    ssn = await conn.session()  # a refused command ends its session
    with pytest.raises(qflow.InvalidArgument, match="queue.remove-sequences: bad range"):
        await ssn._call(P.QUEUE_REMOVE_SEQUENCES, "q", "x", [5, 1])
    ssn = await conn.session()
    assert (await ssn.query_queue("q"))["msgDepth"] == 2  # broker unharmed, nothing lost


async def test_removing_sequences_releases_held_producers(running, nursery):
    """Like consuming, removing by sequence dequeues: a flow-stopped queue
    resumes and its held producer completes."""
    conn = await running.connect()
    ssn = await conn.session()
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 5, "qpid.flow_resume_count": 2})
    sender = ssn.sender("q", capacity=3)
    done = trio.Event()

    async def produce() -> None:
        for i in range(10):
            await sender.send(b"%d" % i)
        await sender.sync()
        done.set()

    nursery.start_soon(produce)
    await wait_for(lambda: sender.incomplete >= 3)
    # The sender's window is full once its sends are written; the broker stops the queue once it has
    # read the fifth: wait for that (the window alone was a race).
    with trio.fail_after(30):
        while not (st := await ssn.query_queue("q"))["flowStopped"]:
            await trio.sleep(0.01)
    assert st["heldTransfers"] >= 1
    while not done.is_set():
        a = await ssn.available("q")
        if a["sequences"]:
            await ssn.remove_sequences("q", a["incarnation"], a["sequences"])
        with trio.move_on_after(0.05):
            await done.wait()
    assert (await ssn.query_queue("q"))["lastSequence"] == 10


async def test_browsing_from_a_sequence_deep_in_the_queue_delivers_from_there_in_order(ssn):
    """A browser that starts at sequence 5001 of 10000 gets 5001..10000, in
    order, a credit window at a time, and takes nothing."""
    await ssn.declare_queue("deep")
    sender = ssn.sender("deep", capacity=1000)
    await sender.send_many(b"%d" % i for i in range(1, 10_001))
    await sender.sync()
    receiver = await ssn.receiver("deep", browse=True, start_sequence=5001, capacity=300)
    got: list[int] = []
    with trio.fail_after(30):
        while len(got) < 5000:
            got += [m.sequence for m in await receiver.fetch_many()]
    assert got == list(range(5001, 10_001))
    assert (await ssn.query_queue("deep"))["msgDepth"] == 10_000


async def test_queue_list_names_the_queues_and_a_timestamp_travels_with_its_message(ssn):
    """queue.list: what a Spark source's queuePattern is matched against. The
    timestamp property: set by the sender, kept by the broker as it is."""
    await fill(ssn, "listed-a", 0)
    await fill(ssn, "listed-b", 0)
    assert {"listed-a", "listed-b"} <= set(await ssn.list_queues())
    await ssn.delete_queue("listed-b")
    assert "listed-b" not in await ssn.list_queues()
    sender = ssn.sender("listed-a", capacity=10)
    await sender.send_with(b"stamped", {"timestamp": 1_790_000_000_123, "message_id": "s"})
    await sender.send_many([b"x", b"y"], timestamp=5)
    await sender.send(b"plain")
    paced = ssn.sender("listed-a", capacity=10, rate=1000.0, durable=True)
    await paced.send_many([b"paced"], timestamp=7)  # one at a time, the same properties
    await paced.send_with(b"default", None)  # the sender's durability
    await paced.send_with(b"transient", {})  # a map is taken as it is
    await sender.sync()
    await paced.sync()
    receiver = await ssn.receiver("listed-a")
    got = [await receiver.fetch(timeout=10) for _ in range(7)]
    assert [(m.body, m.timestamp) for m in got] == [(b"stamped", 1_790_000_000_123), (b"x", 5), (b"y", 5),
                                                    (b"plain", None), (b"paced", 7), (b"default", None),
                                                    (b"transient", None)]
    assert got[0].message_id == "s"
    assert [m.durable for m in got[4:]] == [True, True, False]


@pytest.mark.parametrize("split", [True, False], ids=["the client splits", "one command"])
async def test_remove_sequences_of_more_ranges_than_one_command_takes_goes_in_several(running, monkeypatch, split):
    """The broker takes at most MAX_RANGES ranges in one queue.remove-sequences
    (issue 17's bound); the client's remove_sequences sends more in several
    commands, so a commit of a fragmented read (a Spark batch) is never refused.
    The limit is lowered to 50 here, on the broker and (``split``) in the client."""
    import qflow.broker.commands as commands_module
    import qflow.client.session as session_module

    monkeypatch.setattr(commands_module, "MAX_RANGES", 50)
    monkeypatch.setattr(session_module, "MAX_RANGES", 50 if split else 10_000)
    conn = await running.connect()
    ssn = await conn.session()
    await ssn.declare_queue("fragments")
    sender = ssn.sender("fragments", capacity=500)
    await sender.send_many(b"%d" % i for i in range(1, 301))
    await sender.sync()
    incarnation = (await ssn.available("fragments"))["incarnation"]
    odd = RangeSet([(i, i) for i in range(1, 301, 2)])  # 150 ranges
    if split:
        assert await ssn.remove_sequences("fragments", incarnation, odd) == 150
        assert (await ssn.query_queue("fragments"))["msgDepth"] == 150
        assert list((await ssn.available("fragments", limit=3))["sequences"].ranges()) == [(2, 2), (4, 4), (6, 6)]
    else:
        with pytest.raises(qflow.ResourceLimitExceeded, match="150 ranges"):
            await ssn.remove_sequences("fragments", incarnation, odd)
        assert (await ssn.query_queue("fragments"))["msgDepth"] == 300
