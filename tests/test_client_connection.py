"""The client connection's lifetime (qflow.client.connection): open_connection
owns its tasks, errors reach the caller as ConnectionClosed, the close frame is
the last frame the client sends. Against a small recording broker on
127.0.0.1, so every frame the client writes can be checked."""

from __future__ import annotations

from functools import partial

import msgpack
import pytest
import trio

import qflow
from qflow import protocol as P
from qflow.client import ConnectionClosed, open_connection
from qflow.client.session import Session
from qflow.protocol.framing import PROTOCOL_HEADER

pack = msgpack.packb
TIMEOUT = 10


class RecordingBroker:
    """Records every frame a client sends. It answers the open (with
    ``heartbeat``), attaches, completes every command and answers a close, as
    qflowd does; with ``silent`` it answers the open only."""

    def __init__(self, heartbeat: float = 0, silent: bool = False) -> None:
        self.heartbeat = heartbeat
        self.silent = silent
        self.frames: list[list] = []
        self.done = trio.Event()  # the client's socket closed

    async def serve(self, stream: trio.SocketStream) -> None:
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        header = b""
        next_id: dict[int, int] = {}
        try:
            while len(header) < len(PROTOCOL_HEADER):
                header += await stream.receive_some(len(PROTOCOL_HEADER) - len(header))
            while data := await stream.receive_some(65536):
                unpacker.feed(data)
                for frame in unpacker:
                    self.frames.append(frame)
                    await self._answer(stream, frame, next_id)
        except trio.BrokenResourceError:
            pass
        finally:
            self.done.set()

    async def _answer(self, stream: trio.SocketStream, frame: list, next_id: dict[int, int]) -> None:
        code = frame[0]
        if code == P.OPEN:
            await stream.send_all(pack([P.OPEN_OK, {"heartbeat": self.heartbeat, "max_frame_size": 1 << 20,
                                                    "broker": "recording"}]))
        elif self.silent:
            return
        elif code == P.ATTACH:
            await stream.send_all(pack([P.ATTACHED, frame[1]]))
        elif code == P.CLOSE:
            await stream.send_all(pack([P.CLOSE, P.NORMAL, "closed by the client"]))
        elif code >= P.FIRST_COMMAND:
            n = next_id.get(frame[1], 0)
            next_id[frame[1]] = n + 1
            await stream.send_all(pack([P.COMPLETED, frame[1], [n, n]]))

    def codes(self) -> list[int]:
        return [f[0] for f in self.frames]


async def serve(nursery: trio.Nursery, broker: RecordingBroker) -> int:
    listeners = await nursery.start(partial(trio.serve_tcp, broker.serve, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


def _tasks_below(task: trio.lowlevel.Task) -> list[str]:
    names = []
    for nursery in task.child_nurseries:
        for child in nursery.child_tasks:
            names += [child.name, *_tasks_below(child)]
    return names


async def test_open_connection_runs_its_tasks_in_the_callers_tree(nursery):
    """The reader and writer are tasks below the caller's own (no system
    task), and they are gone when the block ends; connect() still works."""
    port = await serve(nursery, RecordingBroker())
    with trio.fail_after(TIMEOUT):
        async with open_connection("127.0.0.1", port) as conn:
            ssn = await conn.session()
            await ssn.sync()
            below = _tasks_below(trio.lowlevel.current_task())
            assert any(name.endswith("Connection._reader") for name in below), below
            assert any(name.endswith("Connection._writer") for name in below), below
        assert not any("Connection." in name for name in _tasks_below(trio.lowlevel.current_task()))
        assert conn._tasks_done.is_set()
        async with await qflow.connect("127.0.0.1", port) as old_style:
            await (await old_style.session()).sync()
            assert not any("Connection." in name for name in _tasks_below(trio.lowlevel.current_task()))


async def test_leaving_the_block_closes_with_the_close_frame_last(nursery):
    broker = RecordingBroker()
    port = await serve(nursery, broker)
    with trio.fail_after(TIMEOUT):
        async with open_connection("127.0.0.1", port, name="last") as conn:
            ssn = await conn.session()
            sender = ssn.sender("q", capacity=1000)
            await sender.send_many([b"x"] * 300)
            for _ in range(300):
                await sender.send(b"y")
        await broker.done.wait()
    assert broker.frames[0][0] == P.OPEN and broker.frames[0][1]["name"] == "last"
    assert broker.frames[-1] == [P.CLOSE, P.NORMAL, "client closing"]
    assert broker.codes().count(P.TRANSFER) == 600
    with pytest.raises(ConnectionClosed):
        await sender.send(b"after")
    with pytest.raises(ConnectionClosed):
        await conn.session()
    assert broker.codes().count(P.TRANSFER) == 600


async def test_an_exception_in_the_block_propagates_as_itself(nursery):
    broker = RecordingBroker()
    port = await serve(nursery, broker)
    with trio.fail_after(TIMEOUT), pytest.raises(KeyError):  # not an exception group
        async with open_connection("127.0.0.1", port) as conn:
            await conn.session()
            raise KeyError("from the caller")
    with trio.fail_after(TIMEOUT):
        await broker.done.wait()
    assert broker.frames[-1] == [P.CLOSE, P.NORMAL, "client closing"]


async def test_a_refused_open_raises_connection_closed(running):
    """qflowd refuses a frame size below its minimum: open_connection raises the broker's reason."""
    with trio.fail_after(TIMEOUT), pytest.raises(ConnectionClosed) as info:
        async with open_connection(running.host, running.port, max_frame_size=100):
            pytest.fail("the block must not run")
    assert info.value.code == P.COMMAND_INVALID and "max_frame_size" in info.value.text


async def test_a_client_bug_reaches_the_caller(nursery, monkeypatch):
    """A task of the connection failing on a bug is not only logged: the
    waiting call raises ConnectionClosed caused by it, and so does leaving
    the block."""
    port = await serve(nursery, RecordingBroker())

    def broken(self, wire):
        raise RuntimeError("simulated client bug")

    with trio.fail_after(TIMEOUT):
        with pytest.raises(ConnectionClosed) as at_exit:
            async with open_connection("127.0.0.1", port) as conn:
                ssn = await conn.session()
                monkeypatch.setattr(Session, "on_completed", broken)
                with pytest.raises(ConnectionClosed) as in_call:
                    await ssn.sync()
    for err in (in_call.value, at_exit.value):
        assert err.code == P.INTERNAL_ERROR and "simulated client bug" in err.text
        assert isinstance(err.__cause__, RuntimeError)


async def test_a_silent_broker_is_dropped_after_two_heartbeats(nursery):
    """The broker agrees on heartbeat 0.25 s and then says nothing: the
    client sends heartbeats, gives up after 0.5 s of silence, and tells the
    broker why in its last frame."""
    broker = RecordingBroker(heartbeat=0.25, silent=True)
    port = await serve(nursery, broker)
    with trio.fail_after(TIMEOUT):
        async with open_connection("127.0.0.1", port, heartbeat=0.25) as conn:
            with pytest.raises(ConnectionClosed) as info:
                await conn.session()  # never attached
        await broker.done.wait()
    assert (info.value.code, info.value.text) == (P.CONNECTION_FORCED, "no frame from the broker for 0.5 s")
    assert P.HEARTBEAT in broker.codes()
    assert broker.frames[-1] == [P.CLOSE, P.CONNECTION_FORCED, "no frame from the broker for 0.5 s"]


async def test_a_waiting_call_ends_when_the_broker_goes(running):
    """As with connect(): the broker dropping the connection wakes a waiting
    fetch with ConnectionClosed, and the block still ends cleanly."""
    with trio.fail_after(TIMEOUT):
        async with open_connection(running.host, running.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("empty")
            receiver = await ssn.receiver("empty")
            for server_side in list(running.server.connections):
                await server_side.stream.aclose()
            with pytest.raises(ConnectionClosed) as info:
                await receiver.fetch()
    assert "closed by the broker" in info.value.text
