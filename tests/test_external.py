"""SASL EXTERNAL, sans I/O: the verified TLS client certificate's name is the
user (qpidd's --ssl-require-client-authentication with EXTERNAL). The glue
hands the name in (qflow/transport/tls.py certificate_name reads it from the
certificate); the state machine decides. With real qflowd processes and the
tools: tests/test_mutual_tls.py.
"""

from __future__ import annotations

import ssl

import pytest

from qflow.protocol import sasl
from qflow.protocol import spec as P
from qflow.protocol.connection import AuthFailed, ConnectionEnd, ProtocolConnection, Role
from qflow.protocol.framing import PROTOCOL_HEADER
from qflow.transport.tls import certificate_name, client_handshake_failure, handshake_failure
from tests.test_sasl import USERS, move


def server(identity: str | None = None, users=USERS, **kwargs) -> ProtocolConnection:
    s = ProtocolConnection(Role.SERVER, users=users, secret=b"k", **kwargs)
    if identity is not None:
        s.set_peer_identity(identity)
    return s


@pytest.mark.parametrize("users", [USERS, None], ids=["auth-yes", "auth-no"])
def test_external_opens_as_the_certificate_name_whatever_the_auth_setting(users):
    c = ProtocolConnection(Role.CLIENT, name="me", mechanism="EXTERNAL")
    s = server("alice", users)
    [opened] = move(c, s)
    assert opened.user == "alice" and s.user == "alice" and s.mechanism == "EXTERNAL"
    assert move(s, c)[0].user == "alice" and c.is_open


def test_external_without_a_verified_certificate_is_refused_saying_what_it_needs():
    c = ProtocolConnection(Role.CLIENT, name="me", mechanism="EXTERNAL")
    s = server(None)
    with pytest.raises(ConnectionEnd) as info:
        move(c, s)
    assert info.value.code == P.NOT_ALLOWED
    assert info.value.text == ("EXTERNAL needs a TLS connection with a client certificate the broker verified "
                               "(offered: SCRAM-SHA-256, PLAIN)")
    assert not s.is_open


def test_a_certificate_does_not_stop_password_mechanisms():
    """As qpidd: the certificate admits the connection; a client may still log in with a password."""
    c = ProtocolConnection(Role.CLIENT, name="me", username="alice", password="secret", mechanism="PLAIN")
    s = server("bob")
    assert move(c, s)[0].user == "alice"


def test_an_authorisation_identity_other_than_the_certificate_name_fails():
    s2 = server("alice")
    s2.receive_data(PROTOCOL_HEADER, 0.0)
    s2.decoder.feed(b"")
    with pytest.raises(AuthFailed) as info:
        s2.receive_control([P.OPEN, {"mechanism": "EXTERNAL", "response": b"root"}])
    assert (info.value.code, info.value.text) == (P.NOT_ALLOWED, "authentication failed")
    assert "is not the certificate's name 'alice'" in info.value.detail
    assert sasl.external_user("alice", b"alice") == "alice"  # the same name, given explicitly, is fine


def test_the_per_user_limit_counts_the_certificate_name():
    asked = []
    c = ProtocolConnection(Role.CLIENT, name="me", mechanism="EXTERNAL")
    s = server("alice", admit=lambda user: asked.append(user) or "too many connections for user 'alice'")
    with pytest.raises(ConnectionEnd) as info:
        move(c, s)
    assert asked == ["alice"] and info.value.code == P.RESOURCE_LIMIT_EXCEEDED


def test_a_client_asks_for_external_without_a_username():
    with pytest.raises(ValueError, match="EXTERNAL takes no username"):
        ProtocolConnection(Role.CLIENT, username="alice", password="x", mechanism="EXTERNAL")


def _cert(*subject: tuple[str, str]) -> dict:
    return {"subject": tuple(((key, value),) for key, value in subject)}


def test_the_certificate_name_is_its_subject_common_name():
    assert certificate_name(_cert(("countryName", "GB"), ("organizationName", "Example"),
                                  ("commonName", "alice"))) == "alice"
    assert certificate_name(_cert(("commonName", "alice"), ("commonName", "second"))) == "alice"
    # No certificate, no CN, or a CN no user may have: no EXTERNAL.
    assert certificate_name(None) is None and certificate_name({}) is None
    assert certificate_name(_cert(("organizationName", "Example"))) is None
    assert certificate_name(_cert(("commonName", "evil\nERROR forged"))) is None
    assert certificate_name(_cert(("commonName", ""))) is None


def test_handshake_failures_are_one_line():
    verify = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
    verify.verify_message = "Hostname mismatch, certificate is not valid for 'example.com'."
    assert handshake_failure(verify) == ("certificate verify failed: Hostname mismatch, certificate is not valid "
                                         "for 'example.com'.")
    wrapped = RuntimeError("broken")
    wrapped.__cause__ = verify
    assert handshake_failure(wrapped) == handshake_failure(verify)
    eof = ssl.SSLEOFError(8, "EOF occurred in violation of protocol")
    eof.reason = "UNEXPECTED_EOF_WHILE_READING"
    assert handshake_failure(eof) == "unexpected eof while reading"
    assert client_handshake_failure(eof).startswith("unexpected eof while reading (the broker ended the TLS session: "
                                                    "it requires a client certificate")
    # With the client's open unread, the broker's close may arrive as a reset instead: the same hint.
    reset = RuntimeError("socket connection broken")
    reset.__cause__ = ConnectionResetError(104, "Connection reset by peer")
    assert client_handshake_failure(reset) == ("[Errno 104] Connection reset by peer (the broker ended the TLS "
                                               "session: it requires a client certificate signed by a CA it "
                                               "trusts, and none or another was presented)")
