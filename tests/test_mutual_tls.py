"""Mutual TLS end to end (issue 16): a real qflowd with ``--ssl-ca-file`` and
``--ssl-require-client-authentication``, ``--auth yes`` and an ACL, against
the Python client and the real tools, with certificates made at run time
(trustme). The certificate's CN is the user (SASL EXTERNAL on the messaging
port; on the https management API when no Basic credentials come), and the
ACL, /api/connections and the log know it by that name. The protocol's
part, sans I/O: tests/test_external.py.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trustme

import qflow
from tests.conftest import Daemon, start_qflowd
from tests.test_tools import DEADLINE, command, ok, run, run_many

TIMEOUT = 60  # seconds: room for a slow machine, never a timing assertion

# What alice (known only by her certificate) may do: her own queues. tess (a password user) may do anything.
ACL = """\
acl allow tess all
acl allow alice all queue name=alice.*
acl allow alice publish exchange name=amq.default routingkey=alice.*
acl allow alice access exchange
acl deny-log all all
"""


class Pki:
    """The files of one test PKI: a CA, the broker's certificate (for "localhost" only, so that
    127.0.0.1 is a wrong host name), alice's client certificate, and a stranger CA with its own alice."""

    def __init__(self, where: Path) -> None:
        self.where = where
        ca, stranger = trustme.CA(), trustme.CA()
        ca.cert_pem.write_to_path(where / "ca.pem")
        stranger.cert_pem.write_to_path(where / "stranger-ca.pem")
        ca.issue_cert("localhost").private_key_and_cert_chain_pem.write_to_path(where / "broker.pem")
        alice = ca.issue_cert("alice@example.com", common_name="alice")
        alice.cert_chain_pems[0].write_to_path(where / "alice.crt")
        alice.private_key_pem.write_to_path(where / "alice.key")
        stranger.issue_cert("alice@example.com", common_name="alice").private_key_and_cert_chain_pem.write_to_path(
            where / "forged-alice.pem")

    def path(self, name: str) -> str:
        return str(self.where / name)

    def context(self, cert: str | None = "alice.crt", key: str | None = "alice.key",
                ca: str = "ca.pem") -> ssl.SSLContext:
        return qflow.tls_context(ca_file=self.path(ca), cert_file=self.path(cert) if cert else None,
                                 key_file=self.path(key) if key else None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def mtls(pki: Pki) -> Iterator[Daemon]:
    (pki.where / "acl").write_text(ACL)
    db = pki.path("users.json")
    ok(run("qflow-passwd", "--sasl-db", db, "--iterations", "4096", "tess", stdin="t3ss\n"))
    d = start_qflowd("--auth", "yes", "--sasl-db", db, "--acl-file", pki.path("acl"),
                     "--ssl-cert-file", pki.path("broker.pem"), "--ssl-ca-file", pki.path("ca.pem"),
                     "--ssl-require-client-authentication")
    try:
        yield d
    finally:
        d.stop()


def alice_tools(pki: Pki) -> tuple[str, ...]:
    return ("--ssl-trustfile", pki.path("ca.pem"), "--ssl-certificate", pki.path("alice.crt"), "--ssl-key",
            pki.path("alice.key"))


def https(d: Daemon, method: str, path: str, context: ssl.SSLContext, user: str | None = None,
          password: str = "") -> tuple[int, object]:
    conn = http.client.HTTPSConnection("localhost", d.mgmt_port, timeout=TIMEOUT, context=context)
    headers = {"Content-Type": "application/json"} if method != "GET" else {}
    if user is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        conn.request(method, path, body=b"{}" if method == "PUT" else None, headers=headers)
        response = conn.getresponse()
        body = response.read()
        return response.status, json.loads(body) if body else None
    finally:
        conn.close()


async def test_a_client_certificate_authenticates_as_its_cn_for_the_acl_and_api_connections(mtls, pki):
    with trio.fail_after(TIMEOUT):
        async with qflow.open_connection("localhost", mtls.ssl_port, ssl_context=pki.context(),
                                         mechanism="EXTERNAL", name="alice-app") as conn:
            assert conn.user == "alice"
            ssn = await conn.session()
            await ssn.declare_queue("alice.inbox")  # "acl allow alice all queue name=alice.*"
            with pytest.raises(qflow.NotAllowed, match="^not allowed: alice create queue name=payments"):
                await ssn.declare_queue("payments")
            ssn = await conn.session()  # the connection goes on after a denial
            sender = ssn.sender("alice.inbox")
            await sender.send(b"signed")
            await sender.sync()
            # tess, by her password (Basic wins over the certificate that the TLS port requires), sees alice.
            status, views = https(mtls, "GET", "/api/connections", pki.context(), "tess", "t3ss")
            assert status == 200
            assert [v["user"] for v in views if v["name"] == "alice-app"] == ["alice"]
    assert "user 'alice'" in mtls.log()


async def test_password_users_still_log_in_over_mutual_tls(mtls, pki):
    with trio.fail_after(TIMEOUT):
        async with qflow.open_connection("localhost", mtls.ssl_port, ssl_context=pki.context(), username="tess",
                                         password="t3ss") as conn:
            assert conn.user == "tess"


def test_the_management_api_takes_the_certificate_as_the_user(mtls, pki):
    assert https(mtls, "PUT", "/api/queues/alice.api", pki.context())[0] in (200, 201)
    status, body = https(mtls, "PUT", "/api/queues/payments", pki.context())
    assert status == 403 and body["error"].startswith("not allowed: alice create queue name=payments")
    status, views = https(mtls, "GET", "/api/queues", pki.context())
    assert status == 200 and "alice.api" in [v["name"] for v in views] and "payments" not in str(views)
    # Basic credentials, when sent, are checked whatever the certificate.
    assert https(mtls, "GET", "/api/broker", pki.context(), "tess", "wrong")[0] == 401


def test_the_tools_authenticate_with_the_certificate(mtls, pki):
    b = f"amqps://localhost:{mtls.ssl_port}"
    ok(run("qflow-config", "-b", b, *alice_tools(pki), "add", "queue", "alice.tools"))
    ok(run("qflow-send", "-b", b, *alice_tools(pki), "-a", "alice.tools", "--messages", "2",
           "--content-string", "by cert"))
    out = ok(run("qflow-receive", "-b", b, *alice_tools(pki), "-a", "alice.tools", "--messages", "2",
                 "--timeout", "30"))
    assert out.split("\n")[:2] == ["by cert", "by cert"]
    out = ok(run("qflow-stat", "-b", b, *alice_tools(pki), "-q", "alice.tools"))
    assert "msgDepth" in out
    result = run("qflow-config", "-b", b, *alice_tools(pki), "add", "queue", "payments")
    assert result.returncode == 1 and "not allowed: alice create queue name=payments" in result.stderr
    result = run("qflow-send", "-b", b, *alice_tools(pki), "-a", "payments")
    assert result.returncode == 1 and "Traceback" not in result.stderr


def test_no_client_certificate_is_refused_in_the_handshake_and_the_broker_serves_others(mtls, pki):
    b = f"amqps://tess/t3ss@localhost:{mtls.ssl_port}"
    trust = ("--ssl-trustfile", pki.path("ca.pem"))
    forged = ("--ssl-trustfile", pki.path("ca.pem"), "--ssl-certificate", pki.path("forged-alice.pem"))
    calls = [("qflow-send", "-b", b, *trust, "-a", "alice.tools"), ("qflow-config", "-b", b, *trust, "queues"),
             ("qflow-receive", "-b", f"amqps://localhost:{mtls.ssl_port}", *forged, "-a", "alice.tools"),
             ("qflow-stat", "-b", f"tess/t3ss@localhost:{mtls.port}", *trust)]  # https without a certificate
    results = run_many(*calls)
    for call, result in zip(calls, results, strict=True):
        assert result.returncode == 1, (call, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, (call, result.stderr)
        where = (f"the broker's management API at localhost:{mtls.mgmt_port}" if call[0] == "qflow-stat"
                 else f"the broker at localhost:{mtls.ssl_port}")
        assert lines[0].startswith(f"{'Failed: ' if call[0] in ('qflow-stat', 'qflow-config') else call[0] + ': '}"
                                   f"TLS with {where} failed: "), (call, lines)
        assert lines[0].endswith("(the broker ended the TLS session: it requires a client certificate signed by a "
                                 "CA it trusts, and none or another was presented)"), (call, lines)
    log = mtls.log()
    assert re.search(r"connection \S+: TLS handshake failed: peer did not return a certificate", log)
    assert re.search(r"management \S+: TLS handshake failed: peer did not return a certificate", log)
    assert "Traceback" not in log
    # Still serving, the certificate holders and the password users alike.
    ok(run("qflow-config", "-b", f"amqps://localhost:{mtls.ssl_port}", *alice_tools(pki), "queues"))
    ok(run("qflow-stat", "-b", f"tess/t3ss@localhost:{mtls.port}", *alice_tools(pki), "-g"))


async def test_python_client_without_a_certificate_gets_tls_error(mtls, pki):
    with trio.fail_after(TIMEOUT), pytest.raises(qflow.TlsError) as info:
        async with qflow.open_connection("localhost", mtls.ssl_port, ssl_context=pki.context(None, None),
                                         username="tess", password="t3ss") as conn:
            await conn.session()
    assert f"TLS with the broker at localhost:{mtls.ssl_port} failed: " in info.value.text
    assert "client certificate" in info.value.text


def test_wrong_host_name_and_unknown_ca_are_refused_by_the_tools(mtls, pki):
    """The broker's certificate names localhost only: 127.0.0.1 is not its name."""
    wrong_host = ("-b", f"amqps://127.0.0.1:{mtls.ssl_port}", *alice_tools(pki))
    unknown_ca = ("-b", f"amqps://localhost:{mtls.ssl_port}", "--ssl-trustfile", pki.path("stranger-ca.pem"),
                  "--ssl-certificate", pki.path("alice.crt"), "--ssl-key", pki.path("alice.key"))
    calls = [("qflow-send", *wrong_host, "-a", "alice.x"), ("qflow-stat", *wrong_host),
             ("qflow-receive", *unknown_ca, "-a", "alice.x"), ("qflow-config", *unknown_ca, "queues")]
    for call, result in zip(calls, run_many(*calls), strict=True):
        assert result.returncode == 1, (call, result.stdout, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr, (call, result.stderr)
        host = "127.0.0.1" if call[2].startswith("amqps://127") else "localhost"
        assert f"TLS with the broker at {host}:{mtls.ssl_port} failed: certificate verify failed: " in lines[0]
        if host == "127.0.0.1":
            assert "mismatch, certificate is not valid for '127.0.0.1'" in lines[0], lines


def test_qflowd_mutual_tls_option_errors(pki):
    def qflowd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command("qflowd") + ["--port", "0", "--mgmt-port", "0", "--no-data-dir", *args],
                              capture_output=True, text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)

    for args, text in (
            (("--ssl-require-client-auth",), "--ssl-ca-file and --ssl-require-client-authentication need "
                                             "--ssl-cert-file"),
            (("--ssl-ca-file", pki.path("ca.pem")), "need --ssl-cert-file"),
            (("--ssl-cert-file", pki.path("broker.pem"), "--ssl-require-client-authentication"),
             "--ssl-require-client-authentication needs --ssl-ca-file FILE")):
        result = qflowd(*args)
        assert result.returncode == 2 and text in result.stderr and "Traceback" not in result.stderr, result.stderr
    result = qflowd("--ssl-cert-file", pki.path("broker.pem"), "--ssl-ca-file", pki.path("missing.pem"))
    assert result.returncode == 1 and f"cannot load --ssl-ca-file {pki.path('missing.pem')}" in result.stderr
