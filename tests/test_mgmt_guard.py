"""What keeps web pages from driving the management API (qflow.management.guard),
whatever the authentication setting, from issue 16:

> a state-changing request must carry ``Content-Type: application/json``, and is
> refused (403) when its Origin is foreign. A request whose Host is not one of
> the broker's own names or addresses, or a name listed with
> ``--mgmt-allowed-host``, is refused. No CORS headers.

The rules as a unit (sans-I/O), then against a real qflowd over loopback, with
the messages and bindings checked afterwards through the API and the tools.
The browser itself attacks in tests/test_browser_attack.py.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qflow.management.guard import RequestGuard
from qflow.testing import Daemon
from tests.conftest import start_qflowd
from tests.test_tools import config, ok, run

# HTTP behaviour does not depend on the accounting implementation: run once.
pytestmark = pytest.mark.native_only

DEADLINE = 60.0
ALLOWED = ("broker.example.com", "10.1.2.3")


# -- the rules as a unit ------------------------------------------------------------


def check(method: str, **headers: str) -> int | None:
    guard = RequestGuard(ALLOWED)
    guard.listen_on("127.0.0.1")
    refusal = guard.check(method.encode(), [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()],
                          "192.168.7.9")
    return None if refusal is None else refusal.status


@pytest.mark.parametrize(("method", "headers", "status"), [
    # The broker's own names, with or without a port, any case; the operator's names; the address
    # the connection came in on (a Host naming an address cannot be a rebinding).
    ("GET", {"host": "127.0.0.1:8672"}, None),
    ("GET", {"host": "LocalHost"}, None),
    ("GET", {"host": "localhost.:8672"}, None),
    ("GET", {"host": "[::1]:8672"}, None),
    ("GET", {"host": socket.gethostname()}, None),
    ("GET", {"host": "Broker.Example.COM:443"}, None),
    ("GET", {"host": "10.1.2.3"}, None),
    ("GET", {"host": "192.168.7.9:8672"}, None),
    ("GET", {}, None),  # HTTP/1.0 without a Host: no browser sent it
    # DNS rebinding: any other name, for reads too.
    ("GET", {"host": "evil.example"}, 421),
    ("GET", {"host": "evil.example:8672"}, 421),
    ("GET", {"host": "localhost.evil.example"}, 421),
    ("GET", {"host": "127.0.0.1.nip.io"}, 421),
    ("GET", {"host": "192.168.7.10"}, 421),
    ("GET", {"host": "[::2]"}, 421),
    ("GET", {"host": "localhost:8672@evil.example"}, 421),
    ("DELETE", {"host": "evil.example", "content_type": "application/json"}, 421),
    # Origin: absent or our own passes; anything else is refused for a change, not for a read.
    ("POST", {"host": "127.0.0.1:8672", "content_type": "application/json"}, None),
    ("POST", {"host": "127.0.0.1:8672", "origin": "http://127.0.0.1:8672", "content_type": "application/json"},
     None),
    ("PUT", {"host": "broker.example.com", "origin": "https://broker.example.com",
             "content_type": "application/json"}, None),
    ("POST", {"host": "127.0.0.1:8672", "origin": "http://127.0.0.1:8000", "content_type": "application/json"},
     403),
    ("POST", {"host": "127.0.0.1:8672", "origin": "http://evil.example", "content_type": "application/json"}, 403),
    ("PATCH", {"host": "127.0.0.1:8672", "origin": "null", "content_type": "application/json"}, 403),
    ("DELETE", {"host": "127.0.0.1:8672", "origin": "ftp://127.0.0.1:8672", "content_type": "application/json"},
     403),
    ("GET", {"host": "127.0.0.1:8672", "origin": "http://evil.example"}, None),
    # A change must be declared JSON, even with an empty body: what an HTML form cannot do.
    ("POST", {"host": "127.0.0.1:8672"}, 415),
    ("POST", {"host": "127.0.0.1:8672", "content_type": "text/plain"}, 415),
    ("POST", {"host": "127.0.0.1:8672", "content_type": "application/x-www-form-urlencoded"}, 415),
    ("PUT", {"host": "127.0.0.1:8672", "content_type": "multipart/form-data; boundary=x"}, 415),
    ("DELETE", {"host": "127.0.0.1:8672", "content_type": "application/jsonx"}, 415),
    ("PUT", {"host": "127.0.0.1:8672", "content_type": "Application/JSON; charset=utf-8"}, None),
    ("OPTIONS", {"host": "127.0.0.1:8672", "origin": "http://evil.example"}, None),  # the API answers 405
])
def test_request_guard_rules(method: str, headers: dict[str, str], status: int | None) -> None:
    assert check(method, **headers) == status


def test_refusals_name_what_was_wrong_and_escape_it() -> None:
    guard = RequestGuard()
    refusal = guard.check(b"GET", [(b"host", b"evil.example\x1b[2J")])
    assert refusal is not None and refusal.status == 421
    assert "Host 'evil.example\\x1b[2J'" in refusal.message and "--mgmt-allowed-host" in refusal.message
    refusal = guard.check(b"POST", [(b"host", b"localhost"), (b"origin", b"http://evil.example")])
    assert refusal is not None and "Origin 'http://evil.example'" in refusal.message
    refusal = guard.check(b"POST", [(b"host", b"localhost"), (b"content-type", b"text/plain")])
    assert refusal is not None and "Content-Type: application/json" in refusal.message
    assert "'text/plain'" in refusal.message


# -- a real qflowd --------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    args = [a for name in ALLOWED for a in ("--mgmt-allowed-host", name)]
    d = start_qflowd("--mgmt-port", "0", *args)
    try:
        yield d
    finally:
        d.stop()


def request(d: Daemon, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
            ) -> tuple[int, Any]:
    """One request with exactly these headers (a Host among them replaces http.client's).
    Every answer is checked for CORS headers: there must never be one."""
    conn = http.client.HTTPConnection("127.0.0.1", d.mgmt_port, timeout=DEADLINE)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    cors = [k for k, _ in response.getheaders() if k.lower().startswith("access-control-")]
    assert not cors, (method, path, cors)
    try:
        return response.status, json.loads(payload)
    except ValueError:
        return response.status, payload.decode()


JSON = {"Content-Type": "application/json"}


def setup_queue(d: Daemon, name: str, messages: int = 3) -> None:
    ok(config(d, "add", "queue", name))
    ok(run("qflow-send", "-b", d.address, "-a", name, "-m", str(messages), "--content-string", "keep me"))
    assert depth(d, name) == messages


def depth(d: Daemon, name: str) -> int:
    status, q = request(d, "GET", f"/api/queues/{name}")
    assert status == 200, q
    return q["msgDepth"]


def bindings(d: Daemon) -> list[tuple[str, str, str]]:
    status, found = request(d, "GET", "/api/bindings")
    assert status == 200
    return [(b["exchange"], b["queue"], b["key"]) for b in found]


def wait_for_log(d: Daemon, text: str) -> str:
    deadline = time.monotonic() + DEADLINE
    while text not in d.log():
        assert time.monotonic() < deadline, f"{text!r} not in the log:\n{d.log()[-3000:]}"
        time.sleep(0.05)
    return d.log()


def test_dns_rebinding_a_foreign_host_is_refused_for_every_method(daemon: Daemon) -> None:
    d = daemon
    setup_queue(d, "rebound")
    evil = "evil.example"
    for method, path, body in [("GET", "/api/queues", None), ("GET", "/api/connections", None),
                               ("GET", "/api/queues/rebound", None), ("GET", "/metrics", None),
                               ("HEAD", "/api/broker", None),
                               ("POST", "/api/queues/rebound/purge", None),
                               ("DELETE", "/api/queues/rebound", None),
                               ("PUT", "/api/queues/planted", b"{}"),
                               ("POST", "/api/bindings", b'{"exchange": "amq.direct", "queue": "rebound"}')]:
        for host in (evil, f"{evil}:{d.mgmt_port}"):
            status, answer = request(d, method, path, {"Host": host, **JSON}, body)
            assert status == 421, (method, path, answer)
            if method != "HEAD":
                assert f"Host '{host}' is not a name of this broker" in answer["error"]
    assert depth(d, "rebound") == 3
    assert request(d, "GET", "/api/queues/planted")[0] == 404
    assert ("amq.direct", "rebound", "") not in bindings(d)
    log = wait_for_log(d, "refused GET /api/connections from 127.0.0.1:")
    assert f"Host '{evil}' is not a name of this broker" in log


def test_the_brokers_own_names_and_the_allowed_ones_are_answered(daemon: Daemon) -> None:
    d = daemon
    port = d.mgmt_port
    for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", socket.gethostname(),
                 f"[::1]:{port}", "broker.example.com", f"broker.example.com:{port}", "10.1.2.3:80"):
        status, answer = request(d, "GET", "/api/broker", {"Host": host})
        assert status == 200, (host, answer)
    # --mgmt-allowed-host is shown with the broker's options.
    assert request(d, "GET", "/api/broker")[1]["options"]["mgmtAllowedHosts"] == list(ALLOWED)


def test_a_foreign_origin_cannot_change_anything(daemon: Daemon) -> None:
    d = daemon
    setup_queue(d, "crossed")
    for origin in ("http://evil.example", f"http://127.0.0.1:{d.mgmt_port + 1}", "null",
                   f"https://evil.example:{d.mgmt_port}"):
        headers = {"Origin": origin, **JSON}
        for method, path, body in [("POST", "/api/queues/crossed/purge", None),
                                   ("DELETE", "/api/queues/crossed", None),
                                   ("PATCH", "/api/queues/crossed", b'{"arguments": {"qpid.max_count": 1}}'),
                                   ("PUT", "/api/queues/planted", b"{}"),
                                   ("PUT", "/api/exchanges/planted", b'{"type": "fanout"}'),
                                   ("POST", "/api/bindings", b'{"exchange": "amq.direct", "queue": "crossed"}')]:
            status, answer = request(d, method, path, headers, body)
            assert status == 403, (origin, method, path, answer)
            assert f"Origin '{origin}' is not this management API's own origin" in answer["error"]
    assert depth(d, "crossed") == 3
    assert request(d, "GET", "/api/queues/crossed")[1]["arguments"] == {}
    assert request(d, "GET", "/api/queues/planted")[0] == 404
    assert request(d, "GET", "/api/exchanges/planted")[0] == 404
    assert ("amq.direct", "crossed", "") not in bindings(d)
    wait_for_log(d, "refused POST /api/queues/crossed/purge from 127.0.0.1:")
    # Reads with a foreign Origin are answered (without CORS headers a browser shows the page nothing).
    assert request(d, "GET", "/api/queues/crossed", {"Origin": "http://evil.example"})[0] == 200
    # The API's own origin, as its own page would send it, may change things.
    own = {"Host": f"127.0.0.1:{d.mgmt_port}", "Origin": f"http://127.0.0.1:{d.mgmt_port}", **JSON}
    status, answer = request(d, "POST", "/api/queues/crossed/purge", own)
    assert (status, answer["purged"]) == (200, 3)


def test_a_change_must_be_declared_json(daemon: Daemon) -> None:
    """Today's form attacks, without a browser: the bodies an HTML form sends."""
    d = daemon
    setup_queue(d, "formed")
    cases = [
        ("POST", "/api/queues/formed/purge", None, None),
        ("POST", "/api/queues/formed/purge", "text/plain", b""),
        ("POST", "/api/queues/formed/purge", "application/x-www-form-urlencoded", b"x=1"),
        ("POST", "/api/queues/formed/purge", "multipart/form-data; boundary=b", b"--b--\r\n"),
        ("POST", "/api/bindings?exchange=amq.direct&queue=formed&key=k", "application/x-www-form-urlencoded", b""),
        ("POST", "/api/bindings", "text/plain", b'{"exchange": "amq.direct", "queue": "formed", "key": "k="}'),
        ("DELETE", "/api/queues/formed", None, None),
        ("PUT", "/api/queues/planted", "text/plain", b"{}"),
    ]
    for method, path, content_type, body in cases:
        headers = {} if content_type is None else {"Content-Type": content_type}
        status, answer = request(d, method, path, headers, body)
        assert status == 415, (method, path, content_type, answer)
        assert "must have Content-Type: application/json" in answer["error"]
    assert depth(d, "formed") == 3
    assert not [b for b in bindings(d) if b[1] == "formed" and b[0] == "amq.direct"]
    assert request(d, "GET", "/api/queues/planted")[0] == 404
    # A charset parameter is fine; and the tools declare JSON on every change, bodiless ones included.
    status, _ = request(d, "POST", "/api/bindings", {"Content-Type": "application/json; charset=utf-8"},
                        b'{"exchange": "amq.direct", "queue": "formed", "key": "ok"}')
    assert status == 201
    ok(config(d, "unbind", "amq.direct", "formed", "ok"))
    ok(config(d, "purge", "queue", "formed"))
    assert depth(d, "formed") == 0
    ok(config(d, "del", "queue", "formed"))
    assert request(d, "GET", "/api/queues/formed")[0] == 404


def test_no_cors_approval_ever(daemon: Daemon) -> None:
    """A preflight is refused like any method the API does not have, and no
    answer carries an Access-Control-* header (``request`` checks each one)."""
    d = daemon
    for path in ("/api/queues/x/purge", "/api/queues/x", "/api/bindings", "/api/broker"):
        status, answer = request(d, "OPTIONS", path, {
            "Origin": "http://evil.example", "Access-Control-Request-Method": "DELETE",
            "Access-Control-Request-Headers": "content-type"})
        assert status in (404, 405), (path, answer)
    status, _ = request(d, "GET", "/api/broker", {"Origin": "http://evil.example"})
    assert status == 200


@pytest.mark.parametrize("bad", ["evil.example:80", "http://evil.example", "", "a b", "under\nline", "x" * 300])
def test_mgmt_allowed_host_is_checked(bad: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", "--no-data-dir",
                           "--mgmt-allowed-host", bad], capture_output=True, text=True, timeout=DEADLINE)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("qflowd: --mgmt-allowed-host: ") and "not a host name" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_rules_hold_with_authentication_on_and_valid_credentials(tmp_path: Path) -> None:
    """"Whatever the auth setting": a browser replays a user's cached Basic
    credentials, so they must not open the API to another origin's page."""
    db = tmp_path / "users.json"
    ok(run("qflow-passwd", "--sasl-db", str(db), "--iterations", "4096", "alice", stdin="pw\n"))
    d = start_qflowd("--mgmt-port", "0", "--auth", "yes", "--sasl-db", str(db))
    try:
        basic = {"Authorization": "Basic " + base64.b64encode(b"alice:pw").decode()}
        ok(run("qflow-config", "-b", f"alice/pw@127.0.0.1:{d.port}", "add", "queue", "guarded"))
        ok(run("qflow-send", "-b", f"alice/pw@{d.address}", "-a", "guarded", "-m", "3", "--content-string", "x"))
        purge = "/api/queues/guarded/purge"
        assert request(d, "POST", purge, {**basic, "Host": "evil.example", **JSON})[0] == 421
        assert request(d, "GET", "/api/queues", {**basic, "Host": "evil.example"})[0] == 421
        assert request(d, "POST", purge, {**basic, "Origin": "http://evil.example", **JSON})[0] == 403
        assert request(d, "POST", purge, {**basic, "Content-Type": "text/plain"})[0] == 415
        # Without credentials the guard still answers first for a foreign Host; a proper request needs them.
        assert request(d, "GET", "/api/queues", {"Host": "evil.example"})[0] == 421
        assert request(d, "GET", "/api/queues/guarded")[0] == 401
        status, q = request(d, "GET", "/api/queues/guarded", basic)
        assert (status, q["msgDepth"]) == (200, 3)
        status, answer = request(d, "POST", purge, {**basic, **JSON})
        assert (status, answer["purged"]) == (200, 3)
    finally:
        d.stop()
