"""SASL mechanisms, sans I/O: ANONYMOUS, PLAIN (RFC 4616), SCRAM-SHA-256
(RFC 5802, RFC 7677) and EXTERNAL (RFC 4422 appendix A), for both roles.

What a broker keeps per user is a :class:`Verifier`: salt, iteration count,
StoredKey and ServerKey. It holds neither the password nor anything that
logs in without cracking it: a SCRAM client must prove it knows ClientKey,
of which StoredKey is only the hash. PLAIN is checked against the same
verifier (SaltedPassword derived from the given password, compared in
constant time), so one users file serves both mechanisms.

EXTERNAL authenticates with what the transport already proved: the name of
a TLS client certificate the broker verified. The identity comes from the
I/O glue (which alone sees the TLS session); this module only decides
whether the client's message agrees with it.

The connection state machine (``qflow.protocol.connection``) drives these
objects; they know nothing of frames.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from typing import NamedTuple, Protocol

ANONYMOUS = "ANONYMOUS"
PLAIN = "PLAIN"
SCRAM_SHA_256 = "SCRAM-SHA-256"
EXTERNAL = "EXTERNAL"
AUTH_MECHANISMS = (SCRAM_SHA_256, PLAIN)  # offered with --auth yes, best first
DEFAULT_ITERATIONS = 10000  # PBKDF2 rounds for new verifiers (RFC 7677 asks at least 4096)
MIN_ITERATIONS = 4096
MAX_ITERATIONS = 10_000_000  # a bound, so a bad file or broker cannot make a client spin for hours
SALT_BYTES = 16
NONCE_BYTES = 18
FAILED = "authentication failed"  # the one reason a client is told, whatever went wrong


class AuthError(Exception):
    """The exchange failed. ``text`` is what the peer may be told (for a
    server, always :data:`FAILED`); ``detail`` is for this side's log."""

    def __init__(self, text: str, detail: str = "") -> None:
        super().__init__(text)
        self.text = text
        self.detail = detail or text


class Verifier(NamedTuple):
    """What a broker stores per user (RFC 5802 section 3)."""

    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes


class Users(Protocol):
    """The broker's users, as the server side of the exchange asks for them.
    ``usual_iterations``: the iteration count most of them have, which an
    unknown user's decoy shows (another count would tell the user is unknown)."""

    usual_iterations: int

    def verifier(self, user: str) -> Verifier | None: ...


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def salted_password(password: str, salt: bytes, iterations: int) -> bytes:
    """SCRAM's Hi(): PBKDF2-HMAC-SHA-256 of the password (no SASLprep: the
    password's UTF-8 bytes, as given)."""
    return hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)


def make_verifier(password: str, iterations: int = DEFAULT_ITERATIONS, salt: bytes | None = None) -> Verifier:
    """A new verifier for ``password``, with a fresh random salt unless one is given."""
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    salted = salted_password(password, salt, iterations)
    client_key = _hmac(salted, b"Client Key")
    return Verifier(salt, iterations, hashlib.sha256(client_key).digest(), _hmac(salted, b"Server Key"))


def check_password(verifier: Verifier, password: str) -> bool:
    """Whether ``password`` is the one ``verifier`` was made from (PLAIN, HTTP Basic)."""
    salted = salted_password(password, verifier.salt, verifier.iterations)
    stored = hashlib.sha256(_hmac(salted, b"Client Key")).digest()
    return hmac.compare_digest(stored, verifier.stored_key)


def decoy_verifier(user: str, secret: bytes, iterations: int = DEFAULT_ITERATIONS) -> Verifier:
    """A verifier for a user who does not exist: the same salt every time for
    that name (so asking twice tells nothing) and keys nobody can match. The
    exchange runs to its end and fails as a wrong password does."""
    return Verifier(_hmac(secret, b"salt " + user.encode())[:SALT_BYTES], iterations,
                    _hmac(secret, b"stored " + user.encode()), _hmac(secret, b"server " + user.encode()))


# -- PLAIN --------------------------------------------------------------------------
def plain_response(username: str, password: str) -> bytes:
    """PLAIN's one message: [authzid] NUL authcid NUL passwd."""
    return b"\0" + username.encode("utf-8") + b"\0" + password.encode("utf-8")


def parse_plain(response: bytes) -> tuple[str, str]:
    """(user, password) of a PLAIN message. An authzid, if any, must be the user
    itself (qflow has no proxy authorisation)."""
    parts = response.split(b"\0")
    if len(parts) != 3:
        raise AuthError(FAILED, "malformed PLAIN response")
    try:
        authzid, user, password = (p.decode("utf-8") for p in parts)
    except UnicodeDecodeError:
        raise AuthError(FAILED, "PLAIN response is not UTF-8") from None
    if authzid and authzid != user:
        raise AuthError(FAILED, f"PLAIN authorisation identity {authzid!r} is not the user")
    return user, password


def plain_user(response: bytes) -> str:
    """The user a PLAIN message names (with authentication off, nothing is checked)."""
    return parse_plain(response)[0]


# -- EXTERNAL -----------------------------------------------------------------------
def external_user(identity: str | None, response: bytes) -> str:
    """The user of an EXTERNAL exchange: ``identity``, the verified client
    certificate's name. The message is an authorisation identity, empty or
    that same name (no proxy authorisation, as for PLAIN)."""
    if not identity:
        raise AuthError(FAILED, "EXTERNAL without a verified client certificate")
    try:
        authzid = response.decode("utf-8")
    except UnicodeDecodeError:
        raise AuthError(FAILED, "EXTERNAL authorisation identity is not UTF-8") from None
    if authzid and authzid != identity:
        raise AuthError(FAILED, f"EXTERNAL authorisation identity {authzid!r:.60} is not the certificate's "
                                f"name {identity!r:.60}")
    return identity


# -- SCRAM-SHA-256 ----------------------------------------------------------------------
def _nonce() -> str:
    return base64.b64encode(os.urandom(NONCE_BYTES)).decode("ascii")


def _attributes(message: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in message.split(","):
        if len(part) < 2 or part[1] != "=":
            raise AuthError(FAILED, f"malformed SCRAM attribute {part[:20]!r}")
        out.setdefault(part[0], part[2:])
    return out


def _saslname(user: str) -> str:
    return user.replace("=", "=3D").replace(",", "=2C")


def _unsaslname(name: str) -> str:
    if "=" in name.replace("=3D", "").replace("=2C", ""):
        raise AuthError(FAILED, "malformed SCRAM user name")
    return name.replace("=2C", ",").replace("=3D", "=")


def _b64decode(text: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise AuthError(FAILED, "bad base64 in a SCRAM message") from None


def _decode(message: bytes) -> str:
    try:
        return message.decode("utf-8")
    except UnicodeDecodeError:
        raise AuthError(FAILED, "SCRAM message is not UTF-8") from None


class ScramServer:
    """The broker's side of one SCRAM-SHA-256 exchange: :meth:`first` takes the
    client-first message and returns server-first; :meth:`final` takes
    client-final and returns server-final, or raises AuthError."""

    def __init__(self, users: Users, secret: bytes, nonce: str | None = None) -> None:
        self.users = users
        self.secret = secret  # for decoy verifiers: unknown users fail exactly as wrong passwords
        self.user = ""
        self.known = False
        self._nonce = nonce
        self._verifier: Verifier | None = None
        self._auth_message = ""
        self._combined_nonce = ""

    def first(self, client_first: bytes) -> bytes:
        text = _decode(client_first)
        if not text.startswith("n,,"):  # no channel binding, no authzid: all qflow clients send
            raise AuthError(FAILED, "SCRAM client-first must start with 'n,,' (no channel binding, no authzid)")
        bare = text[3:]
        attrs = _attributes(bare)
        if "m" in attrs or "n" not in attrs or "r" not in attrs or not attrs["r"]:
            raise AuthError(FAILED, "malformed SCRAM client-first message")
        self.user = _unsaslname(attrs["n"])
        verifier = self.users.verifier(self.user)
        self.known = verifier is not None
        if verifier is None:
            verifier = decoy_verifier(self.user, self.secret, self.users.usual_iterations)
        self._verifier = verifier
        self._combined_nonce = attrs["r"] + (self._nonce or _nonce())
        server_first = (f"r={self._combined_nonce},s={base64.b64encode(self._verifier.salt).decode('ascii')},"
                        f"i={self._verifier.iterations}")
        self._auth_message = bare + "," + server_first
        return server_first.encode("ascii")

    def final(self, client_final: bytes) -> bytes:
        text = _decode(client_final)
        without_proof, sep, proof_text = text.rpartition(",p=")
        if not sep:
            raise AuthError(FAILED, "SCRAM client-final has no proof")
        attrs = _attributes(without_proof)
        if attrs.get("c") != "biws" or attrs.get("r") != self._combined_nonce:
            raise AuthError(FAILED, "SCRAM client-final: wrong channel binding or nonce")
        verifier = self._verifier
        assert verifier is not None, "final() before first()"
        auth_message = (self._auth_message + "," + without_proof).encode("utf-8")
        proof = _b64decode(proof_text)
        signature = _hmac(verifier.stored_key, auth_message)
        if len(proof) != len(signature):
            raise AuthError(FAILED, "SCRAM proof has the wrong length")
        client_key = bytes(a ^ b for a, b in zip(proof, signature, strict=True))
        if not hmac.compare_digest(hashlib.sha256(client_key).digest(), verifier.stored_key) or not self.known:
            raise AuthError(FAILED, "unknown user" if not self.known else "wrong password")
        return b"v=" + base64.b64encode(_hmac(verifier.server_key, auth_message))


class ScramClient:
    """A client's side of one SCRAM-SHA-256 exchange: :meth:`first` is the
    client-first message, :meth:`final` answers server-first, and
    :meth:`verify` checks the broker's server-final (the broker proves it
    knows the verifier, so a client is not fooled by an impostor)."""

    def __init__(self, username: str, password: str, nonce: str | None = None) -> None:
        self.username = username
        self.password = password
        self._nonce = nonce or _nonce()
        self._bare = f"n={_saslname(username)},r={self._nonce}"
        self._server_signature = b""

    def first(self) -> bytes:
        return ("n,," + self._bare).encode("utf-8")

    def final(self, server_first: bytes) -> bytes:
        text = _decode(server_first)
        attrs = _attributes(text)
        nonce, salt_text, iterations_text = attrs.get("r", ""), attrs.get("s", ""), attrs.get("i", "")
        if not nonce.startswith(self._nonce) or len(nonce) == len(self._nonce) or not iterations_text.isdigit():
            raise AuthError("malformed SCRAM server-first message from the broker")
        iterations = int(iterations_text)
        if not 1 <= iterations <= MAX_ITERATIONS:
            raise AuthError(f"SCRAM iteration count {iterations} from the broker is out of range")
        salted = salted_password(self.password, _b64decode(salt_text), iterations)
        client_key = _hmac(salted, b"Client Key")
        without_proof = f"c=biws,r={nonce}"
        auth_message = f"{self._bare},{text},{without_proof}".encode()
        signature = _hmac(hashlib.sha256(client_key).digest(), auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self._server_signature = _hmac(_hmac(salted, b"Server Key"), auth_message)
        return (without_proof + ",p=" + base64.b64encode(proof).decode("ascii")).encode("ascii")

    def verify(self, server_final: bytes) -> None:
        """Raises AuthError unless ``server_final`` proves the broker knows this user's verifier."""
        text = _decode(server_final)
        if not self._server_signature or not text.startswith("v=") or not hmac.compare_digest(
                _b64decode(text[2:]), self._server_signature):
            raise AuthError("the broker's SCRAM server signature is wrong: it does not know this user's "
                            "verifier (an impostor?)")
