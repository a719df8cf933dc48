"""TLS on the messaging port, end to end: a real qflowd with ``--ssl-cert-file``
and ``--ssl-key-file`` (a test CA's certificate, made by trustme) serving TLS
on ``--ssl-port`` beside its plain port, and the Python client's
``ssl_context``. With ``--auth yes``, PLAIN over TLS is the usual pairing.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trustme

import qflow
from qflow.protocol import spec as P
from tests.conftest import Daemon, start_qflowd
from tests.test_tools import DEADLINE, command, ok, run, run_many

TIMEOUT = 60


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def tls_daemon(ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    where = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.cert_chain_pems[0].write_to_path(where / "cert.pem")
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(where / "cert.pem", append=True)
    cert.private_key_pem.write_to_path(where / "key.pem")
    db = where / "users.json"
    ok(run("qflow-passwd", "--sasl-db", str(db), "--iterations", "4096", "tess", stdin="t3ss\n"))
    d = start_qflowd("--auth", "yes", "--sasl-db", str(db), "--ssl-cert-file", str(where / "cert.pem"),
                     "--ssl-key-file", str(where / "key.pem"))
    try:
        yield d
    finally:
        d.stop()


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    ca.configure_trust(context)
    return context


async def round_trip(port: int, context: ssl.SSLContext | None, **credentials: str) -> bytes:
    with trio.fail_after(TIMEOUT):
        async with qflow.open_connection("127.0.0.1", port, ssl_context=context, **credentials) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("tls")
            sender = ssn.sender("tls")
            await sender.send(b"over tls" * 1000)
            await sender.sync()
            receiver = await ssn.receiver("tls")
            return (await receiver.fetch(timeout=TIMEOUT)).body


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
async def test_a_client_with_the_ca_talks_tls_and_authenticates(tls_daemon, ca, mechanism):
    assert tls_daemon.ssl_port and tls_daemon.ssl_port != tls_daemon.port
    body = await round_trip(tls_daemon.ssl_port, client_context(ca), username="tess", password="t3ss",
                            mechanism=mechanism)
    assert body == b"over tls" * 1000
    # The plain port still serves, beside it.
    assert await round_trip(tls_daemon.port, None, username="tess", password="t3ss") == b"over tls" * 1000


async def test_a_client_that_does_not_trust_the_certificate_is_refused_and_the_broker_goes_on(tls_daemon, ca):
    with trio.fail_after(TIMEOUT), pytest.raises(qflow.TlsError) as info:
        async with qflow.open_connection("127.0.0.1", tls_daemon.ssl_port, ssl_context=ssl.create_default_context(),
                                         username="tess", password="t3ss"):
            pass
    assert info.value.text == (f"TLS with the broker at 127.0.0.1:{tls_daemon.ssl_port} failed: certificate verify "
                               "failed: unable to get local issuer certificate")
    assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)
    assert await round_trip(tls_daemon.ssl_port, client_context(ca), username="tess", password="t3ss")


async def test_a_plain_client_on_the_tls_port_gets_nothing_and_harms_nothing(tls_daemon, ca):
    with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as info:
        async with qflow.open_connection("127.0.0.1", tls_daemon.ssl_port, username="tess", password="t3ss"):
            pass
    assert info.value.code == P.CONNECTION_FORCED
    assert await round_trip(tls_daemon.ssl_port, client_context(ca), username="tess", password="t3ss")


def test_qflowd_tls_option_errors(tmp_path: Path):
    def qflowd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command("qflowd") + ["--port", "0", "--no-data-dir", *args], capture_output=True,
                              text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)

    result = qflowd("--ssl-port", "0")
    assert result.returncode == 2 and "--ssl-key-file and --ssl-port need --ssl-cert-file" in result.stderr
    (tmp_path / "junk.pem").write_text("not a certificate")
    result = qflowd("--ssl-cert-file", str(tmp_path / "junk.pem"))
    assert result.returncode == 1 and f"cannot load --ssl-cert-file {tmp_path / 'junk.pem'}" in result.stderr
    result = qflowd("--ssl-cert-file", str(tmp_path / "missing.pem"))
    assert result.returncode == 1 and "missing.pem" in result.stderr and "ready" not in result.stdout


# -- the management API over TLS, and the tools (one-way TLS: the broker's certificate only) ------------------
def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def https_get(port: int, path: str, context: ssl.SSLContext, headers: dict[str, str] | None = None,
              host: str = "localhost") -> tuple[int, bytes]:
    conn = http.client.HTTPSConnection(host, port, timeout=TIMEOUT, context=context)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


async def test_the_management_api_and_metrics_are_https_and_announced_as_such(tls_daemon, ca):
    """With --ssl-cert-file the management port speaks https only: the API and /metrics over TLS, the
    broker's certificate checked as a browser or curl would; a plain http request gets no answer."""
    status, body = https_get(tls_daemon.mgmt_port, "/api/broker", client_context(ca), basic("tess", "t3ss"))
    assert status == 200 and json.loads(body)["options"]["mgmtSsl"] is True
    status, body = https_get(tls_daemon.mgmt_port, "/metrics", client_context(ca), basic("tess", "t3ss"))
    assert status == 200 and b"qflow_" in body
    plain = http.client.HTTPConnection("127.0.0.1", tls_daemon.mgmt_port, timeout=TIMEOUT)
    with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, http.client.BadStatusLine)):
        plain.request("GET", "/api/broker", headers=basic("tess", "t3ss"))
        plain.getresponse()
    plain.close()
    # The open-ok tells the tools where, and that it is https (on the plain port and the TLS port alike).
    for port, context in ((tls_daemon.port, None), (tls_daemon.ssl_port, client_context(ca))):
        with trio.fail_after(TIMEOUT):
            async with qflow.open_connection("localhost", port, ssl_context=context, username="tess",
                                             password="t3ss") as conn:
                assert conn.server_properties["management_port"] == tls_daemon.mgmt_port
                assert conn.server_properties["management_scheme"] == "https"
    # Unknown CA: refused by the client, and the broker serves the next one.
    with pytest.raises(ssl.SSLCertVerificationError):
        https_get(tls_daemon.mgmt_port, "/api/broker", ssl.create_default_context(), basic("tess", "t3ss"))
    assert https_get(tls_daemon.mgmt_port, "/api/broker", client_context(ca), basic("tess", "t3ss"))[0] == 200


def test_every_tool_speaks_amqps_and_https_with_the_ca_file(tls_daemon, ca, tmp_path):
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    trust = ("--ssl-trustfile", str(tmp_path / "ca.pem"))
    tls_b = f"amqps://tess/t3ss@localhost:{tls_daemon.ssl_port}"
    ok(run("qflow-config", "-b", tls_b, *trust, "add", "queue", "tools.tls"))
    ok(run("qflow-send", "-b", tls_b, *trust, "-a", "tools.tls", "--messages", "3", "--content-string", "hi"))
    # The management API found from the plain port too: the broker says it is https.
    out = ok(run("qflow-stat", "-b", f"tess/t3ss@localhost:{tls_daemon.port}", *trust, "-q", "tools.tls"))
    assert "msgDepth" in out and " 3" in out
    out = ok(run("qflow-config", "-b", tls_b, "--mgmt-url", f"https://localhost:{tls_daemon.mgmt_port}",
                 *trust, "queues"))
    assert "tools.tls" in out
    out = ok(run("qflow-receive", "-b", tls_b, "--ssl-ca-file", str(tmp_path / "ca.pem"), "-a", "tools.tls",
                 "--messages", "3", "--timeout", "30"))
    assert out.split() == ["hi"] * 3


def test_the_tools_refuse_a_certificate_they_cannot_verify_in_one_line(tls_daemon, ca, tmp_path):
    """Unknown CA (no --ssl-trustfile: the system's CAs), for each tool and for the https management API."""
    tls_b = f"amqps://tess/t3ss@localhost:{tls_daemon.ssl_port}"
    calls = [("qflow-send", "-b", tls_b, "-a", "q"), ("qflow-receive", "-b", tls_b, "-a", "q"),
             ("qflow-config", "-b", tls_b, "queues"), ("qflow-stat", "-b", tls_b),
             ("qflow-stat", "-b", f"tess/t3ss@localhost:{tls_daemon.port}")]
    for call, result in zip(calls, run_many(*calls), strict=True):
        assert result.returncode == 1, (call, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, (call, result.stderr)
        where = (f"the broker's management API at localhost:{tls_daemon.mgmt_port}" if "-b" in call and
                 call[2].startswith("tess/") else f"the broker at localhost:{tls_daemon.ssl_port}")
        assert f"TLS with {where} failed: certificate verify failed: " in lines[0], (call, lines)


def test_a_tls_option_without_a_tls_address_is_a_usage_error(tls_daemon, tmp_path):
    for call, text in ((("qflow-send", "-b", f"localhost:{tls_daemon.port}", "-a", "q", "--ssl-trustfile", "x.pem"),
                        "--ssl-trustfile is for TLS: give the broker's TLS address, amqps://HOST:PORT"),
                       (("qflow-receive", "-b", "amqps://localhost", "-a", "q", "--ssl-key", "k.pem"),
                        "--ssl-key needs --ssl-certificate"),
                       (("qflow-config", "-b", "amqps://u/p@localhost", "--sasl-mechanism", "EXTERNAL", "queues"),
                        "--sasl-mechanism EXTERNAL takes no user in -b"),
                       (("qflow-stat", "-b", "localhost", "--sasl-mechanism", "PLAIN"),
                        "--sasl-mechanism PLAIN needs a user")):
        result = run(*call)
        assert result.returncode == 2 and text in result.stderr, (call, result.stderr)
    result = run("qflow-send", "-b", f"amqps://localhost:{tls_daemon.ssl_port}", "-a", "q", "--ssl-trustfile",
                 str(tmp_path / "missing.pem"))
    assert result.returncode == 1 and f"cannot load --ssl-trustfile {tmp_path / 'missing.pem'}" in result.stderr


def test_mgmt_ssl_no_keeps_the_management_api_plain_http(ca, tmp_path):
    cert = ca.issue_cert("localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    d = start_qflowd("--ssl-cert-file", str(tmp_path / "server.pem"), "--mgmt-ssl", "no")
    try:
        conn = http.client.HTTPConnection("localhost", d.mgmt_port, timeout=TIMEOUT)
        conn.request("GET", "/api/broker")
        response = conn.getresponse()
        assert response.status == 200 and json.loads(response.read())["options"]["mgmtSsl"] is False
        conn.close()
        out = ok(run("qflow-stat", "-b", f"localhost:{d.port}", "-g"))  # discovered: http
        assert "Broker Summary" in out
    finally:
        d.stop()


def test_require_encryption_refuses_plain_connections_with_the_way_in(ca, tmp_path):
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_and_cert_chain_pem.write_to_path(tmp_path / "server.pem")
    d = start_qflowd("--ssl-cert-file", str(tmp_path / "server.pem"), "--require-encryption")
    try:
        async def plain() -> qflow.ConnectionClosed:
            with trio.fail_after(TIMEOUT), pytest.raises(qflow.ConnectionClosed) as info:
                async with qflow.open_connection("127.0.0.1", d.port):
                    pass
            return info.value

        refused = trio.run(plain)
        assert refused.code == P.NOT_ALLOWED
        assert refused.text == ("this broker requires encryption (--require-encryption): connect with TLS to port "
                                f"{d.ssl_port}")
        # TLS works; the tools name the refusal in one line.
        assert trio.run(round_trip, d.ssl_port, client_context(ca)) == b"over tls" * 1000
        sent = run("qflow-send", "-b", f"127.0.0.1:{d.port}", "-a", "tls", "--messages", "1")
        assert sent.returncode == 1 and "requires encryption" in sent.stderr and \
            len(sent.stderr.strip().splitlines()) == 1, sent.stderr
        (tmp_path / "ca.pem").write_bytes(ca.cert_pem.bytes())
        out = ok(run("qflow-stat", "-b", f"amqps://localhost:{d.ssl_port}", "--ssl-trustfile",
                     str(tmp_path / "ca.pem"), "-g", "--json"))
        assert json.loads(out)["options"]["requireEncryption"] is True
    finally:
        d.stop()
    assert "refused connection from 127.0.0.1:" in d.log() and "requires encryption" in d.log()


def test_require_encryption_needs_tls_everywhere(tmp_path: Path):
    def qflowd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command("qflowd") + ["--port", "0", "--no-data-dir", *args], capture_output=True,
                              text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)

    result = qflowd("--require-encryption")
    assert result.returncode == 2 and "--require-encryption needs --ssl-cert-file" in result.stderr
    result = qflowd("--require-encryption", "--ssl-cert-file", "x.pem", "--mgmt-ssl", "no")
    assert result.returncode == 2 and "leave --mgmt-ssl yes" in result.stderr
