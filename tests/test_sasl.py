"""Authentication, sans I/O: the SASL mechanisms (qflow.protocol.sasl), the
handshake's authentication step in the connection state machine (both roles,
wired back to back), the users file (qflow.auth.users_file) and the tools'
Qpid broker URL. The same rules with real qflowd processes: tests/test_auth.py.
"""

from __future__ import annotations

import base64
import json
import os
import stat

import msgpack
import pytest
from qflow.cli._addresses import BrokerUrl, parse_url

from qflow.auth.users_file import SaslDb, SaslDbError, check_user_name
from qflow.protocol import sasl
from qflow.protocol import spec as P
from qflow.protocol.connection import AuthFailed, ConnectionEnd, Opened, ProtocolConnection, Role, State
from qflow.protocol.framing import PROTOCOL_HEADER

# RFC 7677 section 3: user "user", password "pencil".
RFC_SALT = base64.b64decode("W22ZaJ0SNY7soEsUEjb6gQ==")
RFC_CLIENT_NONCE = "rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_NONCE = "%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0"
RFC_CLIENT_FIRST = b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
RFC_SERVER_FIRST = b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
RFC_CLIENT_FINAL = (b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
                    b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ=")
RFC_SERVER_FINAL = b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4="
ITERATIONS = sasl.MIN_ITERATIONS  # fast enough for tests; the file's default is higher


class Users(dict):
    usual_iterations = ITERATIONS

    def verifier(self, user: str) -> sasl.Verifier | None:
        return self.get(user)


USERS = Users(alice=sasl.make_verifier("secret", ITERATIONS), user=sasl.make_verifier("pencil", 4096, RFC_SALT))


# -- the mechanisms ------------------------------------------------------------------------
def test_scram_sha_256_matches_the_rfc_7677_example_both_roles():
    client = sasl.ScramClient("user", "pencil", nonce=RFC_CLIENT_NONCE)
    server = sasl.ScramServer(USERS, b"secret", nonce=RFC_SERVER_NONCE)
    assert client.first() == RFC_CLIENT_FIRST
    assert server.first(RFC_CLIENT_FIRST) == RFC_SERVER_FIRST
    assert client.final(RFC_SERVER_FIRST) == RFC_CLIENT_FINAL
    assert server.final(RFC_CLIENT_FINAL) == RFC_SERVER_FINAL
    client.verify(RFC_SERVER_FINAL)  # raises unless the broker proved it knows the verifier
    assert server.user == "user"


def test_scram_refuses_a_wrong_proof_and_a_forged_server_signature():
    server = sasl.ScramServer(USERS, b"s", nonce=RFC_SERVER_NONCE)
    server.first(RFC_CLIENT_FIRST)
    wrong = sasl.ScramClient("user", "pencil2", nonce=RFC_CLIENT_NONCE)
    with pytest.raises(sasl.AuthError) as info:
        server.final(wrong.final(RFC_SERVER_FIRST))
    assert (info.value.text, info.value.detail) == ("authentication failed", "wrong password")
    client = sasl.ScramClient("user", "pencil", nonce=RFC_CLIENT_NONCE)
    client.final(RFC_SERVER_FIRST)
    with pytest.raises(sasl.AuthError, match="server signature is wrong"):
        client.verify(b"v=" + base64.b64encode(b"x" * 32))


def test_an_unknown_user_runs_the_whole_exchange_and_fails_as_a_wrong_password_does():
    """Nothing the broker says tells whether the user exists: a decoy salt,
    the same for the same name each time, and the same final refusal."""
    first = [sasl.ScramServer(USERS, b"k").first(b"n,,n=nobody,r=abc") for _ in range(2)]
    fields = [dict(p.split("=", 1) for p in m.decode().split(",")) for m in first]
    assert fields[0]["s"] == fields[1]["s"]
    assert fields[0]["i"] == str(ITERATIONS)  # what the users have: another count would give it away
    server = sasl.ScramServer(USERS, b"k")
    client = sasl.ScramClient("nobody", "x")
    with pytest.raises(sasl.AuthError) as info:
        server.final(client.final(server.first(client.first())))
    assert (info.value.text, info.value.detail) == ("authentication failed", "unknown user")


def test_plain_is_checked_against_the_same_verifier():
    assert sasl.check_password(USERS["alice"], "secret")
    assert not sasl.check_password(USERS["alice"], "Secret")
    assert sasl.parse_plain(sasl.plain_response("alice", "pw")) == ("alice", "pw")
    assert sasl.parse_plain(b"alice\0alice\0pw") == ("alice", "pw")
    for bad in (b"alice\0pw", b"bob\0alice\0pw", b"\0\xff\0pw"):
        with pytest.raises(sasl.AuthError):
            sasl.parse_plain(bad)


def test_scram_user_names_with_comma_and_equals_are_escaped():
    client = sasl.ScramClient("a,b=c", "pw")
    assert client.first().startswith(b"n,,n=a=2Cb=3Dc,r=")
    server = sasl.ScramServer(Users({"a,b=c": sasl.make_verifier("pw", ITERATIONS)}), b"k")
    client.verify(server.final(client.final(server.first(client.first()))))
    assert server.user == "a,b=c"


# -- the handshake: both roles back to back -------------------------------------------------
def pair(users=USERS, **client_args) -> tuple[ProtocolConnection, ProtocolConnection]:
    c = ProtocolConnection(Role.CLIENT, name="me", **client_args)
    s = ProtocolConnection(Role.SERVER, users=users, secret=b"k")
    return c, s


def move(src: ProtocolConnection, dst: ProtocolConnection) -> list:
    dst.receive_data(src.encoder.take(), 0.0)
    return [dst.receive_control(f) for f in dst.decoder.frames()]


def frames(conn: ProtocolConnection) -> list:
    c = ProtocolConnection(Role.CLIENT)  # a decoder that expects no header
    data = conn.encoder.take()
    if data.startswith(PROTOCOL_HEADER):
        data = data[len(PROTOCOL_HEADER):]
    c.decoder.feed(data)
    return list(c.decoder.frames())


def test_scram_handshake_takes_one_more_round_trip_and_records_the_user():
    c, s = pair(username="alice", password="secret")
    assert move(c, s) == [None]  # the open: answered with a challenge
    assert s.state is State.AUTHENTICATING and not s.sessions
    assert move(s, c) == [None]  # the challenge: answered with the proof
    assert c.state is State.AUTHENTICATING
    assert move(c, s) == [Opened("me", 0, s.max_frame_size, True, "alice")]
    assert move(s, c) == [Opened("qflow", 0, c.max_frame_size, True, "alice")]
    assert c.user == s.user == "alice" and c.is_open and s.is_open


def test_plain_handshake_opens_at_once():
    c, s = pair(username="alice", password="secret", mechanism="PLAIN")
    [opened] = move(c, s)
    assert opened.user == "alice"
    assert move(s, c)[0].user == "alice"


@pytest.mark.parametrize("client_args, user, detail", [
    ({"username": "alice", "password": "wrong"}, "alice", "wrong password"),
    ({"username": "mallory", "password": "secret"}, "mallory", "unknown user"),
    ({"username": "alice", "password": "wrong", "mechanism": "PLAIN"}, "alice", "wrong password"),
    ({"username": "mallory", "password": "x", "mechanism": "PLAIN"}, "mallory", "unknown user"),
])
def test_failed_authentication_is_one_refusal_whatever_went_wrong(client_args, user, detail):
    c, s = pair(**client_args)
    with pytest.raises(AuthFailed) as info:
        for _ in range(2):
            move(c, s)
            move(s, c)
    assert (info.value.code, info.value.text) == (P.NOT_ALLOWED, "authentication failed")
    assert (info.value.user, info.value.detail) == (user, detail)  # for the broker's log only
    s.write_close()
    frames_out = frames(s)
    assert frames_out[-1] == [P.CLOSE, P.NOT_ALLOWED, "authentication failed"]
    assert not any(f[0] == P.OPEN_OK for f in frames_out)
    assert s.state is State.CLOSED and not s.sessions


@pytest.mark.parametrize("opts", [{}, {"mechanism": "ANONYMOUS"}])
def test_anonymous_and_an_old_client_that_names_no_mechanism_are_told_what_is_offered(opts):
    s = ProtocolConnection(Role.SERVER, users=USERS)
    s.receive_data(PROTOCOL_HEADER, 0.0)
    s.decoder.feed(b"")
    with pytest.raises(ConnectionEnd) as info:
        s.receive_control([P.OPEN, opts])
    assert (info.value.code, info.value.text) == (
        P.NOT_ALLOWED, "authentication required: ANONYMOUS is not offered (offered: SCRAM-SHA-256, PLAIN)")


def test_without_users_anonymous_is_offered_and_a_named_user_is_believed():
    """--auth no, as Qpid's: anyone, under whatever name they give."""
    for args, user in (({}, "anonymous"), ({"username": "bob", "password": "x"}, "bob"),
                       ({"username": "eve", "password": "", "mechanism": "PLAIN"}, "eve")):
        c, s = pair(users=None, **args)
        assert move(c, s)[0].user == user
        assert move(s, c)[0].user == user and c.is_open


def test_a_frame_before_the_exchange_ends_is_refused_and_opens_nothing():
    c, s = pair(username="alice", password="secret")
    move(c, s)
    with pytest.raises(ConnectionEnd) as info:
        s.receive_control([P.ATTACH, 0, "early"])
    assert info.value.code == P.COMMAND_INVALID and "authentication in progress" in info.value.text
    assert not s.sessions
    c, s = pair(username="alice", password="secret")
    move(c, s)
    with pytest.raises(AuthFailed):
        s.receive_control([P.SASL_RESPONSE, "not bytes"])


def test_a_client_refuses_an_open_ok_that_skips_its_proof_after_a_challenge():
    c, s = pair(username="alice", password="secret")
    move(c, s)
    move(s, c)  # challenge answered: the client now needs the server's signature
    with pytest.raises(ConnectionEnd) as info:
        c.receive_control([P.OPEN_OK, {"user": "alice"}])
    assert info.value.code == P.NOT_ALLOWED and "server signature" in info.value.text
    assert not c.is_open


def test_client_mechanism_arguments_are_checked():
    with pytest.raises(ValueError, match="PLAIN needs a username"):
        ProtocolConnection(Role.CLIENT, mechanism="PLAIN")
    with pytest.raises(ValueError, match="mechanism must be one of"):
        ProtocolConnection(Role.CLIENT, username="a", password="b", mechanism="KERBEROS")


# -- the users file ---------------------------------------------------------------------------
def test_users_file_holds_verifiers_only_mode_0600_written_atomically(tmp_path):
    path = tmp_path / "users.json"
    db = SaslDb.open(path, missing_ok=True)
    db.users["alice"] = sasl.make_verifier("correct horse", ITERATIONS)
    db.save()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    text = path.read_text()
    assert "correct horse" not in text and "Y29ycmVjdCBob3Jz" not in text  # nor its base64
    entry = json.loads(text)["users"]["alice"]
    assert set(entry) == {"mechanism", "iterations", "salt", "storedKey", "serverKey"}
    assert sorted(os.listdir(tmp_path)) == ["users.json"]  # no temporary file left behind
    again = SaslDb.open(path)
    assert sasl.check_password(again.verifier("alice"), "correct horse")
    assert again.verifier("bob") is None


def test_users_file_is_read_again_when_it_changes_and_a_bad_one_keeps_the_last_users(tmp_path):
    path = tmp_path / "users.json"
    SaslDb(path, {"alice": USERS["alice"]}).save()
    running = SaslDb.open(path)
    SaslDb(path, {"bob": USERS["alice"]}).save()
    assert running.verifier("bob") is not None and running.verifier("alice") is None
    path.write_text("{not json")
    assert running.verifier("bob") is not None  # kept (and logged)


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not valid JSON"),
    ('{"format": "other", "users": {}}', "not a qflow users file"),
    ('{"format": "qflow-sasldb 1", "users": {"a": {"mechanism": "PLAIN"}}}', "user 'a': not a SCRAM-SHA-256"),
    ('{"format": "qflow-sasldb 1", "users": {"a": {"mechanism": "SCRAM-SHA-256", "iterations": 1, '
     '"salt": "", "storedKey": "", "serverKey": ""}}}', "iterations must be"),
])
def test_a_bad_users_file_is_refused_naming_it(tmp_path, content, fragment):
    path = tmp_path / "users.json"
    path.write_text(content)
    with pytest.raises(SaslDbError) as info:
        SaslDb.open(path)
    assert str(path) in str(info.value) and fragment in str(info.value)
    with pytest.raises(SaslDbError, match="does not exist"):
        SaslDb.open(tmp_path / "missing.json")


@pytest.mark.parametrize("name", ["", "a/b", "a@b", "a:b", "line\nbreak", "x" * 256])
def test_user_names_that_would_break_a_url_or_a_log_are_refused(name):
    with pytest.raises(ValueError):
        check_user_name(name)


# -- the tools' broker URL ---------------------------------------------------------------------
@pytest.mark.parametrize("text, url", [
    ("localhost:5672", BrokerUrl("localhost", 5672)),
    ("alice/secret@localhost:5673", BrokerUrl("localhost", 5673, "alice", "secret")),
    ("amqp://alice/s/e@cr@t@[::1]:5674", BrokerUrl("::1", 5674, "alice", "s/e@cr@t")),
    ("bob/@host", BrokerUrl("host", 5672, "bob", "")),
])
def test_qpid_broker_urls_carry_credentials(text, url):
    assert parse_url(text, 5672) == url


@pytest.mark.parametrize("text", ["alice@host:1", "/pw@host:1"])
def test_a_url_with_half_its_credentials_is_refused(text):
    with pytest.raises(Exception, match="USER/PASSWORD@HOST:PORT"):
        parse_url(text, 5672)


def test_a_server_deferring_password_checks_hands_plain_to_the_glue():
    """With ``defer_password_checks`` a PLAIN open is not hashed inline: the
    server hands out a PasswordCheck (an unknown user's with a decoy verifier)
    and opens, or refuses, once told the result."""
    from qflow.protocol import sasl
    from qflow.protocol.connection import AuthFailed, PasswordCheck, ProtocolConnection, Role
    from qflow.protocol.framing import PROTOCOL_HEADER

    class Users:
        usual_iterations = 4096

        def verifier(self, user):
            return sasl.make_verifier("right", 4096) if user == "alice" else None

    def opened_with(user, password, matches):
        server = ProtocolConnection(Role.SERVER, users=Users(), secret=b"s" * 32, now=0.0)
        server.defer_password_checks = True
        server.receive_data(PROTOCOL_HEADER + msgpack.packb(
            [P.OPEN, {"mechanism": "PLAIN", "response": sasl.plain_response(user, password)}]), 0.0)
        (frame,) = server.decoder.frames()
        check = server.receive_control(frame)
        assert type(check) is PasswordCheck and (check.user, check.password) == (user, password)
        assert server.password_check_pending and not server.encoder.parts  # nothing answered yet
        assert sasl.check_password(check.verifier, password) is matches
        return server.finish_password_check(matches)

    assert opened_with("alice", "right", True).user == "alice"
    with pytest.raises(AuthFailed, match="authentication failed") as info:
        opened_with("alice", "wrong", False)
    assert info.value.detail == "wrong password"
    with pytest.raises(AuthFailed) as info:
        opened_with("mallory", "right", False)
    assert info.value.detail == "unknown user"
