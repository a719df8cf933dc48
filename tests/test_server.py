"""The trio server's own guarantees: what ends a connection cleans it up."""

from __future__ import annotations

import pytest
import trio

import qflow
from qflow import protocol as P


async def test_an_internal_error_ends_only_its_connection(running, monkeypatch):
    victim = await running.connect()
    bystander = await running.connect()
    vs, bs = await victim.session(), await bystander.session()
    await bs.declare_queue("kept")
    keeper = bs.sender("kept", capacity=10)
    await keeper.send(b"before")
    await keeper.sync()
    # The victim holds an unaccepted delivery: closing must put it back.
    receiver = await vs.receiver("kept", accept="explicit")
    msg = await receiver.fetch(timeout=10)
    assert msg.body == b"before"

    def broken(*args, **kwargs):
        raise RuntimeError("simulated broker bug")

    monkeypatch.setattr(running.broker, "transfer", broken)
    monkeypatch.setattr(running.broker, "transfer_run", broken)
    await vs.declare_queue("boom")
    with trio.fail_after(10):
        with pytest.raises(qflow.ConnectionClosed) as err:
            sender = vs.sender("boom", capacity=5)
            await sender.send(b"x")
            await sender.sync()
    assert err.value.code == P.INTERNAL_ERROR
    monkeypatch.undo()

    with trio.fail_after(10):
        while running.broker.queues["kept"].consumers:
            await trio.sleep(0.01)
    s = await bs.query_queue("kept")
    assert (s["msgDepth"], s["consumerCount"]) == (1, 0)  # released back, subscription gone
    again = await bs.receiver("kept", accept="auto")
    redelivered = await again.fetch(timeout=10)
    assert (redelivered.body, redelivered.redelivered) == (b"before", True)
    await victim.close()
    await bystander.close()


async def test_producer_rate_limit_spaces_sends(running, ssn):
    await ssn.declare_queue("slow")
    sender = ssn.sender("slow", capacity=100, rate=50)  # 50 msg/s: 11 sends span >= 0.2 s
    start = trio.current_time()
    for _ in range(11):
        await sender.send(b"x")
    assert trio.current_time() - start >= 0.19


async def test_consumer_rate_limit_spaces_fetches(running, ssn):
    await ssn.declare_queue("slow")
    sender = ssn.sender("slow", capacity=100)
    for _ in range(11):
        await sender.send(b"x")
    await sender.sync()
    receiver = await ssn.receiver("slow", rate=50)
    start = trio.current_time()
    for _ in range(11):
        await receiver.fetch(timeout=10)
    assert trio.current_time() - start >= 0.19
