"""The client's exceptions: each broker error code has its type, carrying the
broker's code and text."""

from __future__ import annotations

from qflow import protocol as P


class QflowError(Exception):
    """An error reported by the broker, with its AMQP-style code and text."""

    code = 0

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{text} (code {code})")
        self.code = code
        self.text = text


class NotFound(QflowError):
    pass


class ResourceLocked(QflowError):
    pass


class PreconditionFailed(QflowError):
    pass


class ResourceLimitExceeded(QflowError):
    pass


class InvalidArgument(QflowError):
    pass


class NotAllowed(QflowError):
    pass


class ConnectionClosed(QflowError):
    """The connection ended; ``code``/``text`` say why when the broker said."""


class TlsError(ConnectionClosed):
    """TLS with the broker failed: its certificate could not be verified (an
    unknown CA, a host name it does not name), or the broker refused this
    client's (none, or one it does not trust). ``text`` names the broker's
    address and the reason, in one line."""


class FlowControlTimeout(QflowError):
    """``send`` waited longer than the sender's flow_timeout; the message was not sent."""


_BY_CODE = {P.NOT_FOUND: NotFound, P.RESOURCE_LOCKED: ResourceLocked, P.PRECONDITION_FAILED: PreconditionFailed,
            P.RESOURCE_LIMIT_EXCEEDED: ResourceLimitExceeded, P.INVALID_ARGUMENT: InvalidArgument,
            P.NOT_ALLOWED: NotAllowed}


def error_for(code: int, text: str) -> QflowError:
    """The exception for a broker error ``code`` (QflowError for codes without a type of their own)."""
    return _BY_CODE.get(code, QflowError)(code, text)
