"""Issue 17, resource limits: connection limits, the handshake deadline, the
idle timeout, accept errors, and a connection that cannot even be built.

Each finding of the issue is reproduced here, scaled down: a limit of 2
connections stands for qpidd's 500, a descriptor limit a few above what the
broker holds stands for 20,000 idle connections.
"""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import re
import resource
import socket
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgpack
import pytest
import trio
import trio.testing

import qflow
from qflow import protocol as P
from qflow.broker import Broker
from qflow.protocol.framing import PROTOCOL_HEADER
from qflow.server import Server
from qflow.server import listener as listener_module
from qflow.server.admission import ConnectionLimits, Throttle, accept_forever
from tests.conftest import start_qflowd, wait_for

KIB = 1024
TIMEOUT = 30  # room for a loaded machine; no test waits this long when it passes


@dataclass
class Limited:
    broker: Broker
    server: Server
    port: int

    def open(self, **kwargs):
        return qflow.open_connection("127.0.0.1", self.port, **kwargs)


async def _serve(nursery: trio.Nursery, **limits) -> Limited:
    broker = Broker()
    server = Server(broker, limits=ConnectionLimits(**limits))
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return Limited(broker, server, port)


@pytest.fixture
async def two(nursery) -> AsyncIterator[Limited]:
    """A broker that serves at most two connections (qpidd's --max-connections, scaled down)."""
    yield await _serve(nursery, max_connections=2)


async def _raw_frames_until_eof(sock: trio.SocketStream) -> list[list]:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    with trio.fail_after(TIMEOUT):
        while data := await sock.receive_some(65536):
            unpacker.feed(data)
    return list(unpacker)


# -- --max-connections ---------------------------------------------------------------------------
async def test_max_connections_refuses_the_next_connection_with_a_reason(two):
    """--max-connections 2: a third client is refused, told why (its client
    raises ConnectionClosed naming the limit); the two keep working, and once
    one leaves a new client comes in."""
    async with two.open() as first, two.open() as second:
        with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as err:
            async with two.open():
                pass
        assert err.value.code == P.RESOURCE_LIMIT_EXCEEDED
        assert "connection limit reached: 2 connections (--max-connections)" in err.value.text
        for conn in (first, second):
            ssn = await conn.session()
            await ssn.declare_queue("q")
        await first.close()
        await wait_for(lambda: two.server.admission.count == 1)
        async with two.open() as third:
            await (await third.session()).query_queue("q")
    assert two.server.refused == 1
    await wait_for(lambda: two.server.admission.count == 0)


async def test_connections_still_handshaking_count_toward_the_limit(two):
    """Two raw sockets that never send a byte take both places: the limit is on
    sockets held, whatever they have said."""
    a = await trio.open_tcp_stream("127.0.0.1", two.port)
    b = await trio.open_tcp_stream("127.0.0.1", two.port)
    await wait_for(lambda: two.server.admission.count == 2)
    with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as err:
        async with two.open():
            pass
    assert err.value.code == P.RESOURCE_LIMIT_EXCEEDED
    await a.aclose()
    await b.aclose()
    await wait_for(lambda: two.server.admission.count == 0)
    async with two.open() as conn:
        await conn.session()


async def test_a_refused_raw_client_reads_the_close_frame(two):
    """What a refused client reads, before it has sent anything: one
    connection.close [506, reason], then end of stream (not a reset)."""
    async with two.open(), two.open():
        sock = await trio.open_tcp_stream("127.0.0.1", two.port)
        await sock.send_all(PROTOCOL_HEADER + msgpack.packb([P.OPEN, {}]))
        frames = await _raw_frames_until_eof(sock)
        await sock.aclose()
    assert frames == [[P.CLOSE, P.RESOURCE_LIMIT_EXCEEDED,
                       "connection limit reached: 2 connections (--max-connections)"]]


async def test_refusals_are_logged_once_per_interval_not_once_each(two, caplog):
    caplog.set_level(logging.INFO, logger="qflow.server")
    async with two.open(), two.open():
        for _ in range(5):
            with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed):
                async with two.open():
                    pass
    refusals = [r for r in caplog.records if "refused connection" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]
    assert two.server.refused == 5


async def test_connection_limit_per_ip(nursery):
    """--connection-limit-per-ip 1: a second connection from 127.0.0.1 is
    refused, naming the address; the total limit is not what refused it."""
    served = await _serve(nursery, max_connections=0, per_ip=1)
    async with served.open():
        with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as err:
            async with served.open():
                pass
    assert err.value.code == P.RESOURCE_LIMIT_EXCEEDED
    assert err.value.text == ("connection limit per address reached: 1 connections from 127.0.0.1 "
                              "(--connection-limit-per-ip)")
    await wait_for(lambda: served.server.admission.per_ip == {})


# -- --max-negotiate-time and --idle-timeout -------------------------------------------------------
@pytest.mark.parametrize("sent", [b"", PROTOCOL_HEADER], ids=["nothing", "header-only"])
async def test_a_connection_that_does_not_finish_its_handshake_is_closed(nursery, sent):
    """--max-negotiate-time: a socket that sends nothing (or only the header)
    is closed with a reason once the time is up, and its place is free."""
    served = await _serve(nursery, max_connections=1, negotiate_time=0.2)
    sock = await trio.open_tcp_stream("127.0.0.1", served.port)
    await sock.send_all(sent)
    frames = await _raw_frames_until_eof(sock)
    await sock.aclose()
    assert frames == [[P.CLOSE, P.CONNECTION_FORCED,
                       "handshake not finished within 0.2 seconds (--max-negotiate-time)"]]
    await wait_for(lambda: served.server.admission.count == 0)
    async with served.open() as conn:  # the handshake done, the deadline no longer applies
        await trio.sleep(0.4)
        await (await conn.session()).declare_queue("q")


async def test_idle_timeout_closes_a_silent_connection_without_heartbeats(nursery):
    """--idle-timeout: a client that negotiated no heartbeat and sends nothing
    is closed with a reason; one with heartbeats is governed by them instead."""
    served = await _serve(nursery, idle_timeout=0.3)
    async with served.open(heartbeat=1) as beating:
        with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as err:
            async with served.open() as conn:
                ssn = await conn.session()
                await ssn.declare_queue("idle")
                receiver = await ssn.receiver("idle")
                await receiver.fetch()  # waits: nothing is sent, and the broker ends it
        assert (err.value.code, err.value.text) == (P.CONNECTION_FORCED, "no frame for 0.3 seconds (--idle-timeout)")
        await (await beating.session()).declare_queue("still-here")


# -- accept errors never end the listener ------------------------------------------------------------
class _FailingListener:
    """accept() fails with each of ``errors`` in turn, then reports the listener closed."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = errors

    async def accept(self):
        await trio.sleep(0)
        if self.errors:
            raise self.errors.pop(0)
        raise trio.ClosedResourceError


async def test_accept_errors_are_retried_and_logged_once_per_interval(caplog, autojump_clock):
    caplog.set_level(logging.INFO, logger="qflow.server")
    emfile = [OSError(errno.EMFILE, "Too many open files") for _ in range(50)]
    other = [OSError(errno.EPERM, "Operation not permitted"), MemoryError()]
    throttle = Throttle(clock=trio.current_time)
    async with trio.open_nursery() as nursery:
        await accept_forever(_FailingListener(emfile + other), None, nursery, throttle)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records]
    emfile_lines = [line for line in lines if "EMFILE" in line]
    # 50 failures, the pause doubling to 1 s, over about 45 s: a line per 10 s, each counting those it stood for
    assert len(emfile_lines) <= 6, lines
    counted = [int(m.group(1)) for line in emfile_lines if (m := re.search(r"\((\d+) more since", line))]
    assert 2 <= len(emfile_lines) and len(emfile_lines) + sum(counted) <= 50  # the last few await a next line
    assert any("EPERM" in line for line in lines) and any("out of memory" in line for line in lines)
    assert not any(r.exc_info for r in caplog.records)  # no traceback per failed accept


def test_throttle_counts_what_it_did_not_log(caplog):
    now = [0.0]
    throttle = Throttle(interval=10, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="qflow.server")
    assert throttle.log(logging.WARNING, "k", "refused %s", "a")
    assert not throttle.log(logging.WARNING, "k", "refused %s", "b")
    assert throttle.log(logging.WARNING, "other", "other kind")
    now[0] = 10.0
    assert throttle.log(logging.WARNING, "k", "refused %s", "c")
    assert [r.getMessage() for r in caplog.records] == [
        "refused a", "other kind", "refused c (1 more since the last such line)"]


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.native_only
async def test_out_of_descriptors_the_broker_keeps_listening(tmp_path):
    """The 20,000 idle connections, scaled down: qflowd's descriptor limit set a
    few above what it holds, then twenty sockets to the protocol port and five
    to the management port. Accept fails with EMFILE; qflowd logs it (not a
    traceback per accept), stays up, and both ports serve again as soon as
    descriptors are free."""
    d = start_qflowd("--no-data-dir")
    socks: list[socket.socket] = []
    try:
        pid = d.proc.pid
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (_open_fds(pid) + 3, hard))
        for port in (d.port,) * 20 + (d.mgmt_port,) * 5:  # both ports: the issue's made both unreachable
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT))
        await wait_for(lambda: "EMFILE" in d.log(), TIMEOUT)
        assert d.proc.poll() is None
        for s in socks:
            s.close()
        socks.clear()
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        with trio.fail_after(TIMEOUT):
            async with qflow.open_connection("127.0.0.1", d.port) as conn:
                ssn = await conn.session()
                await ssn.declare_queue("alive")
        with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}/api/queues/alive", timeout=TIMEOUT) as r:
            assert json.load(r)["name"] == "alive"
        log = d.log()
        assert "Traceback" not in log, log
        assert log.count("EMFILE") <= 3, log
    finally:
        for s in socks:
            s.close()
        d.stop()


# -- the death case: a connection that cannot be built -------------------------------------------------
async def test_running_out_of_memory_building_a_connection_ends_only_that_connection(nursery, monkeypatch):
    """The issue's broker died when a new connection ran out of memory while
    its connection object was built, outside the per-connection error
    handling. Forced here: the object's construction raises MemoryError. The
    client sees its connection end; the broker, its queued message and its
    other connections are unharmed; the next connection is served. The
    client is told why (506, "broker out of memory")."""
    served = await _serve(nursery)
    async with served.open() as keeper:
        ssn = await keeper.session()
        await ssn.declare_queue("kept")
        sender = ssn.sender("kept", capacity=10)
        await sender.send(b"precious")
        await sender.sync()
        real = listener_module.Connection

        def out_of_memory(*args, **kwargs):
            raise MemoryError

        monkeypatch.setattr(listener_module, "Connection", out_of_memory)
        with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as err:
            async with served.open():
                pass
        assert (err.value.code, err.value.text) == (P.RESOURCE_LIMIT_EXCEEDED, "broker out of memory")
        monkeypatch.setattr(listener_module, "Connection", real)
        await wait_for(lambda: served.server.admission.count == 1)
        async with served.open() as later:
            receiver = await (await later.session()).receiver("kept")
            assert (await receiver.fetch(timeout=TIMEOUT)).body == b"precious"


def _address_space(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


@pytest.mark.native_only
async def test_out_of_memory_new_connections_are_refused_and_the_broker_lives():
    """The death case with a real limit, scaled down from 1 GiB: qflowd's address
    space capped 150 MiB above what it uses, and a queue with no limit
    (qpid.max_size 0) filled until the broker runs out. The producer's
    connection ends; each new connection then fails, mostly with a reason
    (506 "broker out of memory", or 541 if memory ran out after it was
    built), instead of killing the broker, which is still running."""
    d = start_qflowd("--no-data-dir")
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            await (await conn.session()).declare_queue(
                "big", arguments={"qpid.max_size": 0, "qpid.flow_stop_size": 0, "qpid.flow_stop_count": 0})
        pid = d.proc.pid
        resource.prlimit(pid, resource.RLIMIT_AS, (_address_space(pid) + 150 * 1024 * KIB, resource.RLIM_INFINITY))
        with trio.fail_after(120), pytest.raises(qflow.ConnectionClosed) as err:
            async with qflow.open_connection("127.0.0.1", d.port) as conn:
                sender = (await conn.session()).sender("big", capacity=1000)
                while True:
                    await sender.send_many([b"x" * KIB] * 1000)
        # The producer's connection ends: with a reason if it reads it before its own unread
        # sends reset the socket (TCP's rule, not the broker's choice), else as a reset.
        assert err.value.code in (P.RESOURCE_LIMIT_EXCEEDED, P.INTERNAL_ERROR, P.CONNECTION_FORCED), err.value
        assert d.proc.poll() is None
        codes: list[int] = []
        for _ in range(3):
            try:
                with trio.fail_after(TIMEOUT):
                    async with qflow.open_connection("127.0.0.1", d.port) as conn:
                        await conn.session()
            except qflow.ConnectionClosed as exc:
                codes.append(exc.code)
        # The issue's broker was dead by now: these connections were refused by the kernel (OSError).
        # The reasons themselves are checked exactly by the forced MemoryError above; here a
        # reset is possible when even draining the client's bytes finds no memory.
        assert set(codes) <= {P.RESOURCE_LIMIT_EXCEEDED, P.INTERNAL_ERROR, P.CONNECTION_FORCED}, codes
        assert d.proc.poll() is None, d.log()[-3000:]
    finally:
        d.kill()  # a clean stop needs memory this broker no longer has
        d.stop()


# -- qflowd's options --------------------------------------------------------------------------------
async def test_qflowd_max_connections_and_negotiate_time():
    """The real qflowd with --max-connections 1 --max-negotiate-time 300: a
    second client is refused with the reason; a raw socket that says nothing
    is closed after the negotiate time; the options show in the management API."""
    d = start_qflowd("--no-data-dir", "--max-connections", "1", "--max-negotiate-time", "300")
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as err:
                async with qflow.open_connection("127.0.0.1", d.port):
                    pass
            assert err.value.text == "connection limit reached: 1 connections (--max-connections)"
            await (await conn.session()).declare_queue("q")
        sock = None
        with trio.fail_after(TIMEOUT):
            while True:  # the place frees once the broker has seen the client go
                sock = await trio.open_tcp_stream("127.0.0.1", d.port)
                frames = await _raw_frames_until_eof(sock)
                await sock.aclose()
                if frames[0][1] != P.RESOURCE_LIMIT_EXCEEDED:
                    break
                await trio.sleep(0.05)
        assert frames == [[P.CLOSE, P.CONNECTION_FORCED,
                           "handshake not finished within 0.3 seconds (--max-negotiate-time)"]]
        assert "refused connection from 127.0.0.1" in d.log()
    finally:
        d.stop()


@pytest.mark.parametrize("args", [["--max-connections", "-1"], ["--max-negotiate-time", "-5"],
                                  ["--connection-limit-per-ip", "-1"], ["--connection-limit-per-user", "-2"],
                                  ["--idle-timeout", "nan"]])
def test_qflowd_refuses_bad_limits(args):
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--no-data-dir", "--port", "0", *args],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 2, done
    assert done.stderr.startswith("qflowd: --") and done.stderr.count("\n") == 1, done.stderr


# -- orderly shutdown ------------------------------------------------------------------------------------
async def test_sigterm_tells_every_client_why():
    """SIGTERM: a waiting consumer, a producer held by flow control, and a raw
    socket still in its handshake each read connection.close [320, "broker
    shutting down"] before their socket ends (the issue's clients got EOF)."""
    d = start_qflowd("--no-data-dir")
    try:
        errors: dict[str, qflow.ConnectionClosed] = {}
        async with qflow.open_connection("127.0.0.1", d.port) as cc, \
                qflow.open_connection("127.0.0.1", d.port) as pc:
            cs, ps = await cc.session(), await pc.session()
            await ps.declare_queue("held", arguments={"qpid.flow_stop_count": 5, "qpid.flow_resume_count": 2})
            await cs.declare_queue("idle")
            receiver = await cs.receiver("idle")
            sender = ps.sender("held", capacity=20)
            for _ in range(10):
                await sender.send(b"x")
            await wait_for(lambda: ps.held_by, TIMEOUT)
            raw = await trio.open_tcp_stream("127.0.0.1", d.port)
            await raw.send_all(PROTOCOL_HEADER)

            async def expect(name: str, wait) -> None:
                try:
                    await wait()
                except qflow.ConnectionClosed as exc:
                    errors[name] = exc

            with trio.fail_after(TIMEOUT):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(expect, "consumer", receiver.fetch)
                    nursery.start_soon(expect, "producer", sender.sync)
                    await trio.testing.wait_all_tasks_blocked()
                    d.proc.terminate()
                raw_frames = await _raw_frames_until_eof(raw)
            await raw.aclose()
        assert {name: (e.code, e.text) for name, e in errors.items()} == {
            "consumer": (P.CONNECTION_FORCED, "broker shutting down"),
            "producer": (P.CONNECTION_FORCED, "broker shutting down")}
        assert raw_frames == [[P.CLOSE, P.CONNECTION_FORCED, "broker shutting down"]]
        assert d.proc.wait(timeout=TIMEOUT) == 0
    finally:
        d.stop()


# -- TLS ------------------------------------------------------------------------------------------------
async def test_limits_apply_to_tls_connections_too(nursery):
    """The TLS port shares the count: --max-connections 1 refuses a second TLS
    client with the reason, read over TLS; a TCP client that never starts its
    TLS handshake is dropped at the negotiate time and frees its place."""
    import ssl

    import trustme

    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    server = Server(Broker(), limits=ConnectionLimits(max_connections=1, negotiate_time=0.3))
    port = await nursery.start(server.serve, "127.0.0.1", 0, server_context)
    async with qflow.open_connection("127.0.0.1", port, ssl_context=client_context) as conn:
        with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as err:
            async with qflow.open_connection("127.0.0.1", port, ssl_context=client_context):
                pass
        assert (err.value.code, err.value.text) == (
            P.RESOURCE_LIMIT_EXCEEDED, "connection limit reached: 1 connections (--max-connections)")
        await conn.session()
    await wait_for(lambda: server.admission.count == 0)
    silent = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(TIMEOUT):
        assert await silent.receive_some(100) == b""  # no TLS, so no reason can be read: just the end
    await silent.aclose()
    await wait_for(lambda: server.admission.count == 0)


# -- --connection-limit-per-user -------------------------------------------------------------------------
async def test_connection_limit_per_user(tmp_path):
    """--connection-limit-per-user 1 with authentication on: alice's second
    connection is refused after she authenticates, with the reason; bob, on
    the same address, is served; once alice's first leaves she comes back."""
    from tests.test_auth import passwd
    from tests.test_tools import ok

    db = tmp_path / "users.json"
    ok(passwd(db, "alice", "a-pass", "--iterations", "4096"))
    ok(passwd(db, "bob", "b-pass", "--iterations", "4096"))
    d = start_qflowd("--no-data-dir", "--auth", "yes", "--sasl-db", str(db), "--connection-limit-per-user", "1")
    try:
        alice = {"username": "alice", "password": "a-pass"}
        async with qflow.open_connection("127.0.0.1", d.port, **alice) as first:
            with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as err:
                async with qflow.open_connection("127.0.0.1", d.port, **alice):
                    pass
            assert (err.value.code, err.value.text) == (
                P.RESOURCE_LIMIT_EXCEEDED,
                "connection limit per user reached: 1 connections for user 'alice' (--connection-limit-per-user)")
            async with qflow.open_connection("127.0.0.1", d.port, username="bob", password="b-pass") as bob:
                await bob.session()
            await first.session()
        with trio.fail_after(TIMEOUT):
            while True:  # the place frees once the broker has seen her first connection go
                try:
                    async with qflow.open_connection("127.0.0.1", d.port, **alice) as again:
                        await again.session()
                        break
                except qflow.ConnectionClosed as exc:
                    assert exc.code == P.RESOURCE_LIMIT_EXCEEDED, exc
                    await trio.sleep(0.05)
        with urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{d.mgmt_port}/api/broker",
                headers={"Authorization": "Basic " + base64.b64encode(b"bob:b-pass").decode()}),
                timeout=TIMEOUT) as r:
            assert json.load(r)["options"]["connectionLimitPerUser"] == 1
    finally:
        d.stop()
