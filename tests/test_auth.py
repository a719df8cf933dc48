"""Authentication end to end: real qflowd processes with ``--auth yes`` and a
users file written by the real ``qflow-passwd``; the Python client, the tools
with Qpid's ``USER/PASS@HOST:PORT`` and the management API's HTTP Basic. The
rules in units: tests/test_sasl.py.
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import stat
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio

import qflow
from qflow.protocol import spec as P
from qflow.protocol.framing import PROTOCOL_HEADER
from tests.conftest import Daemon, start_qflowd
from tests.test_tools import DEADLINE, command, ok, refused, run, wait_for

TIMEOUT = 60  # seconds: room for a slow machine, never a timing assertion


def passwd(db: Path, user: str, password: str | None, *args: str) -> subprocess.CompletedProcess[str]:
    return run("qflow-passwd", "--sasl-db", str(db), *args, user, stdin=None if password is None else password + "\n")


@pytest.fixture(scope="module")
def users(tmp_path_factory: pytest.TempPathFactory) -> Path:
    db = tmp_path_factory.mktemp("auth") / "users.json"
    ok(passwd(db, "alice", "s3cret/@:x", "--iterations", "4096"))
    ok(passwd(db, "bob", "hunter2", "--iterations", "4096"))
    return db


@pytest.fixture(scope="module")
def daemon(users: Path) -> Iterator[Daemon]:
    d = start_qflowd("--auth", "yes", "--sasl-db", str(users))
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def own_daemon(users: Path) -> Iterator[Daemon]:
    """A qflowd of the test's own: its failed attempts are logged at most once per address per 10 s
    (qflow.server.auth_guard), so a test that reads the log of one must not share the broker."""
    d = start_qflowd("--auth", "yes", "--sasl-db", str(users))
    try:
        yield d
    finally:
        d.stop()


async def refusal(d: Daemon, **credentials: Any) -> qflow.ConnectionClosed:
    with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as info:
        async with qflow.open_connection("127.0.0.1", d.port, **credentials):
            pass
    return info.value


async def healthy(d: Daemon) -> None:
    """The broker still serves a good client, start to finish."""
    with trio.fail_after(TIMEOUT):
        async with qflow.open_connection("127.0.0.1", d.port, username="bob", password="hunter2") as conn:
            ssn = await conn.session()
            await ssn.declare_queue("health")
            sender = ssn.sender("health")
            await sender.send(b"ok")
            await sender.sync()
            receiver = await ssn.receiver("health")
            assert (await receiver.fetch(timeout=TIMEOUT)).body == b"ok"


def mgmt(d: Daemon, path: str, user: str | None = None, password: str = "") -> tuple[int, dict[str, Any], Any]:
    request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}{path}")
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


# -- the messaging port ----------------------------------------------------------------------
@pytest.mark.parametrize("mechanism", [None, "PLAIN"])
async def test_a_user_logs_in_and_is_recorded_on_the_connection_and_its_sessions(daemon, mechanism):
    """SCRAM-SHA-256 by default, PLAIN when asked; /api/connections names the user."""
    with trio.fail_after(TIMEOUT):
        async with qflow.open_connection("127.0.0.1", daemon.port, username="alice", password="s3cret/@:x",
                                         mechanism=mechanism, name=f"who-{mechanism}") as conn:
            assert conn.user == "alice"
            await conn.session("s1")
            _, _, conns = await trio.to_thread.run_sync(mgmt, daemon, "/api/connections", "bob", "hunter2")
            [mine] = [c for c in conns if c["name"] == f"who-{mechanism}"]
            assert mine["user"] == "alice" and [s["user"] for s in mine["sessions"]] == ["alice"]


@pytest.mark.parametrize("credentials", [
    {"username": "alice", "password": "wrong"},
    {"username": "nobody", "password": "s3cret/@:x"},
    {"username": "alice", "password": "wrong", "mechanism": "PLAIN"},
    {"username": "nobody", "password": "x", "mechanism": "PLAIN"},
])
async def test_failed_authentication_closes_with_one_reason_logs_it_and_harms_nothing(own_daemon, credentials):
    daemon = own_daemon
    err = await refusal(daemon, **credentials)
    assert (err.code, err.text) == (P.NOT_ALLOWED, "authentication failed")  # not whether the user exists
    user = credentials["username"]

    def logged() -> bool:
        return any("authentication failed for user" in line and f"'{user}'" in line and "127.0.0.1:" in line
                   for line in daemon.log().splitlines())

    with trio.fail_after(TIMEOUT):
        while not logged():
            await trio.sleep(0.05)
    await healthy(daemon)


async def test_a_user_name_cannot_forge_a_log_line(own_daemon):
    daemon = own_daemon
    await refusal(daemon, username="evil\n2026-01-01 INFO qflow: forged", password="x")
    with trio.fail_after(TIMEOUT):
        while "evil\\x0a2026" not in daemon.log():
            await trio.sleep(0.05)
    assert not any(line.startswith("2026-01-01 INFO qflow: forged") for line in daemon.log().splitlines())


REQUIRED = "authentication required: ANONYMOUS is not offered (offered: SCRAM-SHA-256, PLAIN)"


async def test_anonymous_and_old_clients_are_told_authentication_is_required(daemon):
    err = await refusal(daemon)
    assert (err.code, err.text) == (P.NOT_ALLOWED, REQUIRED)
    # A client older than authentication names no mechanism: it meant ANONYMOUS, and hears the same.
    with trio.fail_after(TIMEOUT):
        stream = await trio.open_tcp_stream("127.0.0.1", daemon.port)
        await stream.send_all(PROTOCOL_HEADER + msgpack.packb([P.OPEN, {"name": "old", "heartbeat": 0}]))
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
        await stream.aclose()
    assert msgpack.unpackb(data) == [P.CLOSE, P.NOT_ALLOWED, REQUIRED]
    await healthy(daemon)


async def test_a_user_added_or_deleted_with_qflow_passwd_counts_from_the_next_connection(daemon, users):
    ok(await trio.to_thread.run_sync(lambda: passwd(users, "carol", "c4rol", "--iterations", "4096")))
    with trio.fail_after(TIMEOUT):
        async with qflow.open_connection("127.0.0.1", daemon.port, username="carol", password="c4rol") as conn:
            assert conn.user == "carol"
    ok(await trio.to_thread.run_sync(lambda: passwd(users, "carol", None, "--delete")))
    assert (await refusal(daemon, username="carol", password="c4rol")).text == "authentication failed"


async def test_ssl_context_is_used_for_the_connection(daemon):
    """The client speaks TLS when given a context: against a plain-TCP broker the
    TLS handshake itself fails (its plain port does not speak TLS): one TlsError naming the address."""
    context = ssl.create_default_context()
    with trio.fail_after(TIMEOUT), pytest.raises(qflow.TlsError) as info:
        async with qflow.open_connection("127.0.0.1", daemon.port, username="bob", password="hunter2",
                                         ssl_context=context):
            pass
    assert info.value.text.startswith(f"TLS with the broker at 127.0.0.1:{daemon.port} failed: ")
    await healthy(daemon)


# -- the management API ------------------------------------------------------------------------
def test_management_api_needs_http_basic_of_a_user(daemon):
    status, headers, body = mgmt(daemon, "/api/broker")
    assert status == 401 and "Basic" in headers["www-authenticate"] and "authentication required" in body["error"]
    for user, password in (("alice", "wrong"), ("nobody", "x")):
        status, _, body = mgmt(daemon, "/api/broker", user, password)
        assert (status, body) == (401, {"error": "authentication failed"})
    status, _, body = mgmt(daemon, "/api/broker", "alice", "s3cret/@:x")
    assert status == 200 and body["options"]["auth"] is True
    assert "authentication failed for user 'nobody'" in daemon.log()


# -- the tools ------------------------------------------------------------------------------
def test_every_tool_passes_the_credentials_of_its_broker_url(daemon):
    creds = "alice/s3cret/@:x@"
    # One address for every tool: the management tools find the management API from the messaging port.
    mgmt_url = url = f"{creds}127.0.0.1:{daemon.port}"
    ok(run("qflow-config", "-b", mgmt_url, "add", "queue", "tooled"))
    # The log says who made the change (the management lookup's probe connection is logged at debug only).
    log = daemon.log()
    assert re.search(r"management change by 127\.0\.0\.1:\d+ \(user 'alice'\): PUT /api/queues/tooled done \(201\)",
                     log), log[-2000:]
    ok(run("qflow-send", "-b", url, "-a", "tooled", "--messages", "2", "--content-string", "hi"))
    assert ok(run("qflow-receive", "-b", url, "-a", "tooled", "--messages", "2", "--timeout", "30")).split() \
        == ["hi", "hi"]
    assert "tooled" in ok(run("qflow-stat", "-b", mgmt_url, "-q"))
    # qflow-stat -c names each connection's user: its own management request is not one, so keep one open.
    with subprocess.Popen(command("qflow-receive") + ["-b", url, "-a", "tooled", "--forever", "--connection-name",
                                                      "watched"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          stdin=subprocess.DEVNULL) as receiver:
        try:
            def shown() -> list[str]:
                out = ok(run("qflow-stat", "-b", mgmt_url, "-c"))
                return [line for line in out.splitlines() if "watched" in line]

            rows = wait_for("the receiver in qflow-stat -c", shown)
            assert rows[0].split()[1:3] == ["watched", "alice"]
        finally:
            receiver.terminate()
    # Without credentials, or with wrong ones: a clear refusal, exit 1, no traceback.
    refused(run("qflow-config", "-b", f"127.0.0.1:{daemon.port}", "queues"), 1, "authentication required")
    refused(run("qflow-stat", "-b", f"alice/bad@127.0.0.1:{daemon.port}"), 1, "authentication failed")
    # The management API found another way (--mgmt-url) still wants the credentials, given with -b.
    refused(run("qflow-config", "--mgmt-url", f"127.0.0.1:{daemon.mgmt_port}", "queues"), 1,
            "authentication required")
    assert "tooled" in ok(run("qflow-config", "-b", f"{creds}127.0.0.1:{daemon.port}", "--mgmt-url",
                              f"127.0.0.1:{daemon.mgmt_port}", "queues"))
    refused(run("qflow-send", "-b", f"alice/bad@127.0.0.1:{daemon.port}", "-a", "tooled"), 1,
            "authentication failed")
    refused(run("qflow-receive", "-b", f"127.0.0.1:{daemon.port}", "-a", "tooled", "--timeout", "1"), 1,
            "authentication required")
    refused(run("qflow-send", "-b", f"alice@127.0.0.1:{daemon.port}", "-a", "tooled"), 2, "USER/PASSWORD@")


def test_qflow_passwd_writes_a_0600_file_without_the_password_and_deletes(tmp_path):
    db = tmp_path / "users.json"
    ok(passwd(db, "dave", "pa55word"))
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    assert "pa55word" not in db.read_text() and json.loads(db.read_text())["users"]["dave"]["iterations"] >= 4096
    ok(passwd(db, "dave", None, "--delete"))
    assert json.loads(db.read_text())["users"] == {}
    refused(passwd(db, "dave", None, "--delete"), 1, "no user 'dave'")
    refused(passwd(db, "dave", ""), 1, "must not be empty")
    refused(passwd(db, "a/b", "x"), 2, "must be printable, without '/'")
    refused(run("qflow-passwd", "--sasl-db", str(tmp_path / "no" / "dir.json"), "eve", stdin="x\n"), 1,
            "cannot write users file")


# -- qflowd's options ---------------------------------------------------------------------------
def qflowd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command("qflowd") + ["--port", "0", "--no-data-dir", *args], capture_output=True,
                          text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_qflowd_refuses_a_non_loopback_address_without_an_explicit_auth(host, users):
    for args in ((), ("--sasl-db", str(users))):
        result = qflowd("--host", host, *args)
        assert result.returncode == 2 and "--auth" in result.stderr and "ready" not in result.stdout, result


def test_qflowd_auth_option_errors(users, tmp_path):
    result = qflowd("--auth", "yes")
    assert result.returncode == 2 and "--auth yes needs --sasl-db FILE" in result.stderr
    result = qflowd("--auth", "yes", "--sasl-db", str(tmp_path / "missing.json"))
    assert result.returncode == 1 and "missing.json does not exist" in result.stderr
    (tmp_path / "bad.json").write_text("[]")
    result = qflowd("--auth", "yes", "--sasl-db", str(tmp_path / "bad.json"))
    assert result.returncode == 1 and "not a qflow users file" in result.stderr
    result = qflowd("--auth", "maybe")
    assert result.returncode == 2 and "expected yes or no" in result.stderr


async def test_auth_no_offers_anonymous_and_believes_a_named_user(users):
    """--auth no (the loopback default): ANONYMOUS, and credentials accepted
    unchecked, as Qpid's --auth no; the management API needs none."""
    d = start_qflowd()
    try:
        with trio.fail_after(TIMEOUT):
            async with qflow.open_connection("127.0.0.1", d.port) as conn:
                assert conn.user == "anonymous"
            async with qflow.open_connection("127.0.0.1", d.port, username="zed", password="any") as conn:
                assert conn.user == "zed"
        status, _, body = await trio.to_thread.run_sync(mgmt, d, "/api/broker")
        assert status == 200 and body["options"]["auth"] is False
    finally:
        d.stop()


async def test_sasl_db_alone_turns_authentication_on(users):
    d = start_qflowd("--sasl-db", str(users))
    try:
        assert (await refusal(d)).code == P.NOT_ALLOWED
        with trio.fail_after(TIMEOUT):
            async with qflow.open_connection("127.0.0.1", d.port, username="bob", password="hunter2") as conn:
                assert conn.user == "bob"
    finally:
        d.stop()


def test_qflow_passwd_prompts_twice_on_a_terminal(tmp_path):
    """On a terminal the password is asked for twice, unechoed; a mismatch sets nothing."""
    def on_terminal(*answers: str) -> tuple[int, str]:
        master, slave = os.openpty()
        proc = subprocess.Popen(command("qflow-passwd") + ["--sasl-db", str(tmp_path / "tty.json"), "--iterations",
                                                           "4096", "tina"],
                                stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        out = b""
        try:
            for answer in answers:
                while b":" not in out.rsplit(b"\n", 1)[-1]:  # wait for the prompt
                    chunk = os.read(master, 1024)
                    assert chunk, out
                    out += chunk
                os.write(master, answer.encode() + b"\n")
                out += b"\n"
            code = proc.wait(timeout=DEADLINE)
            try:
                while chunk := os.read(master, 1024):
                    out += chunk
            except OSError:  # EIO: the child closed the terminal
                pass
        finally:
            os.close(master)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return code, out.decode(errors="replace")

    code, out = on_terminal("t1na-pw", "t1na-pw")
    assert code == 0 and "Password:" in out and "Again:" in out and "t1na-pw" not in out, out
    db = json.loads((tmp_path / "tty.json").read_text())
    assert list(db["users"]) == ["tina"]
    code, out = on_terminal("one", "two")
    assert code == 1 and "the passwords do not match" in out, out
    assert json.loads((tmp_path / "tty.json").read_text()) == db  # nothing changed
