"""What TLS tells about a peer, for the glue of either role: the name a
verified client certificate gives its user (SASL EXTERNAL), and why a
handshake failed, in one line for a log or a tool's error. No I/O: these
read what ``ssl`` already established.
"""

from __future__ import annotations

import ssl
from typing import Any

# What a TLS session the broker ends before the connection opens usually means.
PEER_ENDED_HINT = ("the broker ended the TLS session: it requires a client certificate signed by a CA it trusts, "
                   "and none or another was presented")


def certificate_name(cert: dict[str, Any] | None) -> str | None:
    """The user a verified TLS client certificate names: its subject's common
    name (CN), as qpidd takes it (the first CN, in ``SSLSocket.getpeercert()``'s
    form). None when there is no certificate, no CN, or a CN no user may have
    (empty, or with control characters: it would be written into the log)."""
    if not cert:
        return None
    names = [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    if not names or not names[0] or not names[0].isprintable():
        return None
    return names[0]


def handshake_failure(exc: BaseException) -> str:
    """Why a TLS handshake failed, in one line: the certificate check's own
    words when that failed ("certificate verify failed: Hostname mismatch,
    ..."), else OpenSSL's reason ("peer did not return a certificate"). ``exc``
    is the ssl error, or the error trio wrapped it in."""
    cause = exc if isinstance(exc, ssl.SSLError) else exc.__cause__
    if isinstance(cause, ssl.SSLCertVerificationError) and cause.verify_message:
        return f"certificate verify failed: {cause.verify_message}"
    if isinstance(cause, ssl.SSLError) and cause.reason:
        return cause.reason.replace("_", " ").lower()
    if cause is not None:
        return str(cause) or type(cause).__name__
    return str(exc) or "connection closed during the TLS handshake"


def client_handshake_failure(exc: BaseException) -> str:
    """:func:`handshake_failure` as a client says it. A broker that refuses
    this client's certificate (or its lack of one) may close the TLS session
    without a word: say what that usually means."""
    reason = handshake_failure(exc)
    cause = exc if isinstance(exc, OSError) else exc.__cause__
    if "eof" in reason or "certificate required" in reason or isinstance(cause, ConnectionResetError):
        reason += f" ({PEER_ENDED_HINT})"
    return reason
