"""One address for every tool, as in Qpid: ``-b`` is the broker's messaging
address for qflow-config and qflow-stat too. They learn the management port
from the broker (``management_port`` in connection.open-ok), or take
``--mgmt-url``. A tool pointed at the wrong kind of port says so in one line,
and a part of the address it would otherwise ignore (a TLS scheme: the tools
do not connect over TLS) is refused. Credentials authenticate the tool, over
the protocol and to the management API (tests/test_auth.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from qflow.cli._addresses import BrokerUrl, parse_url

import qflow
from qflow.client.address import AddressError, parse_address
from qflow.protocol.connection import WRONG_PORT_HINT, ConnectionEnd, ProtocolConnection, Role
from tests.conftest import Daemon

BIN = Path(sys.executable).parent
DEADLINE = 60.0
TOOLS = ("qflow-config", "qflow-stat", "qflow-send", "qflow-receive")


def run(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / name), *args], capture_output=True, text=True, timeout=DEADLINE,
                          stdin=subprocess.DEVNULL)


def run_many(*calls: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    procs = [subprocess.Popen([str(BIN / name), *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name, *args in calls]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=DEADLINE)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


# -- the URL: Qpid's [user/pass@]host[:port] ------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("localhost:5672", BrokerUrl("localhost", 5672)),
    ("example.com", BrokerUrl("example.com", 5672)),
    (":5673", BrokerUrl("localhost", 5673)),
    ("amqp://10.0.0.1:5673", BrokerUrl("10.0.0.1", 5673)),
    ("amqp:tcp:10.0.0.1:5673", BrokerUrl("10.0.0.1", 5673)),
    ("[::1]:5674", BrokerUrl("::1", 5674)),
    ("guest/guest@localhost:5672", BrokerUrl("localhost", 5672, "guest", "guest")),
    ("amqp://alice/p@ss/w0rd@example.com", BrokerUrl("example.com", 5672, "alice", "p@ss/w0rd")),
    # TLS, Qpid's amqps:// (and its older amqp:ssl:), port 5671 unless given
    ("amqps://localhost", BrokerUrl("localhost", 5671, tls=True)),
    ("amqps://guest/guest@localhost:5673", BrokerUrl("localhost", 5673, "guest", "guest", True)),
    ("amqp:ssl:localhost:5674", BrokerUrl("localhost", 5674, tls=True)),
])
def test_broker_urls_accepted(text: str, expected: BrokerUrl) -> None:
    assert parse_url(text) == expected


@pytest.mark.parametrize(("text", "message"), [
    ("guest@localhost:5672", "USER/PASSWORD@"),
    ("https://localhost:8672", "--mgmt-url"),
    ("http://localhost:8672", "--mgmt-url"),
    ("localhost:0", "bad port"),
    ("localhost:99999", "bad port"),
])
def test_broker_urls_refused_never_ignored(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_url(text)


# -- the client's parser of HOST:PORT, which the tools and the Spark source share ---------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("broker.example:5673", ("broker.example", 5673)),
    (" 10.0.0.1 ", ("10.0.0.1", 5672)),
    ("[::1]:5674", ("::1", 5674)),
    ("[fe80::1%eth0]", ("fe80::1%eth0", 5672)),
])
def test_the_client_parses_host_and_port(text: str, expected: tuple[str, int]) -> None:
    assert parse_address(text) == expected


@pytest.mark.parametrize(("text", "problem"), [
    ("", "empty"), ("[::1", "brackets"), ("[::1]x", "brackets"), ("::1", "ipv6"), (":5672", "no host"),
    ("[]:5672", "no host"), ("guest@host", "host"), ("host/path", "host"), ("my host", "host"),
    ("host:", "port"), ("host:+5", "port"), ("host:0", "range"), ("host:65536", "range"),
])
def test_the_client_says_what_is_wrong_with_an_address(text: str, problem: str) -> None:
    with pytest.raises(AddressError) as info:
        parse_address(text)
    assert (info.value.problem, info.value.address) == (problem, text)
    assert not text or repr(text) in str(info.value)  # the message names the address


def test_a_default_host_fills_in_only_a_missing_host() -> None:
    assert parse_address(":5673", default_host="localhost") == ("localhost", 5673)
    assert parse_address("", 8672, default_host="localhost") == ("localhost", 8672)
    with pytest.raises(AddressError, match="no address between its brackets"):
        parse_address("[]", default_host="localhost")


def test_client_told_it_reached_an_http_port() -> None:
    client = ProtocolConnection(Role.CLIENT, name="lost")
    with pytest.raises(ConnectionEnd) as info:
        client.receive_data(b"HTTP/1.1 400 Bad Request\r\n", 0.0)
    assert info.value.text == WRONG_PORT_HINT and "management port" in info.value.text


def test_open_ok_carries_what_the_server_announces() -> None:
    server = ProtocolConnection(Role.SERVER, announce={})
    server.announce["management_port"] = 8999  # filled in after the listener is built, as qflowd does
    client = ProtocolConnection(Role.CLIENT, name="tool")
    server.receive_data(client.encoder.take(), 0.0)
    for frame in server.decoder.frames():
        server.receive_control(frame)
    client.receive_data(server.encoder.take(), 0.0)
    for frame in client.decoder.frames():
        client.receive_control(frame)
    assert client.peer_properties["management_port"] == 8999


# -- against a real qflowd --------------------------------------------------------------------------------



async def test_the_broker_announces_its_management_port(daemon: Daemon) -> None:
    async with qflow.open_connection("127.0.0.1", daemon.port) as conn:
        assert conn.server_properties["management_port"] == daemon.mgmt_port


@pytest.mark.native_only
def test_every_tool_takes_the_messaging_address(daemon: Daemon) -> None:
    b = f"127.0.0.1:{daemon.port}"
    assert run("qflow-config", "-b", b, "add", "queue", "one-address").returncode == 0
    send = run("qflow-send", "-b", b, "-a", "one-address", "--content-string", "hi")
    assert send.returncode == 0, send.stderr
    stat = run("qflow-stat", "-b", b, "-q")
    assert stat.returncode == 0 and "one-address" in stat.stdout, stat.stderr
    # The explicit management URL, with and without its scheme.
    for mgmt in (f"127.0.0.1:{daemon.mgmt_port}", f"http://127.0.0.1:{daemon.mgmt_port}"):
        listed = run("qflow-config", "--mgmt-url", mgmt, "queues")
        assert listed.returncode == 0 and "one-address" in listed.stdout, listed.stderr
    got = run("qflow-receive", "-b", b, "-a", "one-address")
    assert got.returncode == 0 and got.stdout == "hi\n"
    assert run("qflow-config", "-b", b, "del", "queue", "one-address").returncode == 0


@pytest.mark.native_only
def test_wrong_port_gives_a_one_line_hint(daemon: Daemon) -> None:
    m = f"127.0.0.1:{daemon.mgmt_port}"
    b = f"127.0.0.1:{daemon.port}"
    calls = [("qflow-stat", "-b", m), ("qflow-config", "-b", m, "queues"), ("qflow-send", "-b", m, "-a", "q"),
             ("qflow-receive", "-b", m, "-a", "q"), ("qflow-stat", "--mgmt-url", b),
             ("qflow-config", "--mgmt-url", b, "queues")]
    for call, result in zip(calls, run_many(*calls), strict=True):
        assert result.returncode == 1, (call, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, (call, result.stderr)
        assert ("management port" in lines[0] if "-b" in call else "messaging port" in lines[0]), (call, lines)
        assert "\\x" not in lines[0] and "QFLOW" not in lines[0]  # no raw protocol bytes


@pytest.mark.native_only
def test_tls_to_a_plain_port_fails_in_one_line_naming_the_address(daemon: Daemon) -> None:
    """amqps:// is taken by every tool; against the plain messaging port, the TLS handshake fails: one line
    naming the broker's address and why, exit 1 (tests/test_tls_tools.py has the real TLS broker)."""
    calls = []
    for tool in TOOLS:
        extra = ("-a", "q") if tool in ("qflow-send", "qflow-receive") else ()
        calls.append((tool, "-b", f"amqps://127.0.0.1:{daemon.port}", *extra))
        calls.append((tool, "-b", f"amqp:ssl:guest/guest@127.0.0.1:{daemon.port}", *extra))
    for call, result in zip(calls, run_many(*calls), strict=True):
        assert result.returncode == 1, (call, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, (call, result.stderr)
        assert f"TLS with the broker at 127.0.0.1:{daemon.port} failed: " in lines[0], (call, lines)


@pytest.mark.native_only
def test_credentials_reach_a_broker_without_auth(daemon: Daemon) -> None:
    """Authentication off (the default on loopback): credentials are taken, not refused."""
    b = f"guest/guest@127.0.0.1:{daemon.port}"
    result = run("qflow-stat", "-b", b, "-g")
    assert result.returncode == 0 and "Broker Summary" in result.stdout, result.stderr


@pytest.mark.native_only
def test_no_management_port_announced_names_mgmt_url() -> None:
    """A broker that does not announce one (here: a plain TCP server that is
    not qflowd at all is the other failure) gets a hint, not a traceback."""
    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"\xc1garbage")  # 0xc1 is never valid msgpack
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    try:
        result = run("qflow-stat", "-b", f"127.0.0.1:{port}")
    finally:
        t.join(DEADLINE)
        listener.close()
    assert result.returncode == 1 and "does not speak qflow's protocol" in result.stderr, result.stderr


@pytest.mark.native_only
def test_json_output(daemon: Daemon) -> None:
    b = f"127.0.0.1:{daemon.port}"
    assert run("qflow-config", "-b", b, "add", "queue", "jsonq", "--max-queue-count", "7").returncode == 0
    views = {"-g": dict, "-q": list, "-e": list, "-u": list, "-c": list}
    calls = [("qflow-stat", "-b", b, view, "--json") for view in views]
    calls += [("qflow-stat", "-b", b, "-q", "jsonq", "--json"), ("qflow-config", "-b", b, "queues", "--json"),
              ("qflow-config", "-b", b, "--json"), ("qflow-config", "-b", b, "exchanges", "--json")]
    results = run_many(*calls)
    for (view, kind), result in zip(views.items(), results, strict=False):
        assert result.returncode == 0, result.stderr
        assert isinstance(json.loads(result.stdout), kind), view
    one, queues, summary, exchanges = (json.loads(r.stdout) for r in results[len(views):])
    assert one["name"] == "jsonq" and one["arguments"] == {"qpid.max_count": 7}
    assert "jsonq" in [q["name"] for q in queues]
    assert summary["name"] == "qflowd" and "totals" in summary
    assert {"amq.direct", "amq.fanout", "amq.topic"} <= {e["name"] for e in exchanges}
    assert run("qflow-config", "-b", b, "del", "queue", "jsonq").returncode == 0
