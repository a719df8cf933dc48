"""The trio server's own guarantees: what ends a connection cleans it up."""

from __future__ import annotations

import msgpack
import pytest
import trio
import trio.testing

import qflow
from qflow import protocol as P
from qflow.broker import Broker
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE, PROTOCOL_HEADER
from qflow.server import Connection


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


# -- the broker's close frame -------------------------------------------------------
async def _serve_memory(broker: Broker, opts: dict) -> tuple[Connection, trio.testing.MemoryStapledStream]:
    client_end, server_end = trio.testing.memory_stream_pair()
    conn = Connection(broker, server_end, DEFAULT_MAX_FRAME_SIZE, "memory")
    await client_end.send_all(PROTOCOL_HEADER + msgpack.packb([P.OPEN, opts]))
    return conn, client_end


async def _frames_until_eof(stream) -> list[list]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    while data := await stream.receive_some(65536):
        unpacker.feed(data)
    return list(unpacker)


async def test_a_heartbeat_timeout_sends_its_close_frame_last(autojump_clock):
    """A silent peer with heartbeat=1: the broker sends heartbeats every second
    and drops the peer after two. On the mock clock the last heartbeat falls due
    at the very instant the timeout does; the close frame still comes last."""
    conn, peer = await _serve_memory(Broker(), {"heartbeat": 1})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        frames = await _frames_until_eof(peer)
    assert frames[0][0] == P.OPEN_OK
    assert P.HEARTBEAT in [f[0] for f in frames]
    assert frames[-1] == [P.CLOSE, P.CONNECTION_FORCED, "no frame for 2 seconds (heartbeat)"]


async def test_a_stopping_broker_sends_a_close_reason(autojump_clock):
    """Shutdown cancels every connection: each is told why before its socket closes."""
    conn, peer = await _serve_memory(Broker(), {"heartbeat": 1})
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        await trio.sleep(1.5)  # heartbeats are flowing
        nursery.cancel_scope.cancel()
    frames = await _frames_until_eof(peer)
    assert frames[-1] == [P.CLOSE, P.CONNECTION_FORCED, "broker shutting down"]


async def test_sigterm_gives_clients_a_close_reason(qflowd):
    c = await qflow.connect("127.0.0.1", qflowd.port)
    ssn = await c.session()
    await ssn.declare_queue("q")
    receiver = await ssn.receiver("q")
    qflowd.proc.terminate()
    with trio.fail_after(10), pytest.raises(qflow.ConnectionClosed) as err:
        await receiver.fetch()
    assert (err.value.code, err.value.text) == (P.CONNECTION_FORCED, "broker shutting down")
    await c.close()
