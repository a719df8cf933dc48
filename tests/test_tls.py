"""TLS on the messaging port, end to end: a real qflowd with ``--ssl-cert-file``
and ``--ssl-key-file`` (a test CA's certificate, made by trustme) serving TLS
on ``--ssl-port`` beside its plain port, and the Python client's
``ssl_context``. With ``--auth yes``, PLAIN over TLS is the usual pairing.
"""

from __future__ import annotations

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
from tests.test_tools import DEADLINE, command, ok, run

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
