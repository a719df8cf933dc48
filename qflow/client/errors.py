"""The client's exceptions: each broker error code has its type, carrying the
broker's code and text."""

from __future__ import annotations

from qflow import protocol as P


class QflowError(Exception):
    """An error the broker reported, or the client's own in the broker's terms.

    The base of every error below: ``except qflow.QflowError`` catches them all.

    Attributes:
      code: the AMQP-style code (404, 530, ...).
      text: the broker's (or the client's) explanation, for people.
    """

    code = 0

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{text} (code {code})")
        self.code = code
        self.text = text


class NotFound(QflowError):
    """The broker's 404: the queue, exchange or subscription named does not exist."""


class ResourceLocked(QflowError):
    """The broker's 405: the queue is exclusive to another session."""


class PreconditionFailed(QflowError):
    """The broker's 406: a condition the command set did not hold (``if_empty``,
    ``if_unused``, a queue's incarnation)."""


class ResourceLimitExceeded(QflowError):
    """The broker's 506, or the client's own: a limit was reached (a queue's
    size, a message larger than the connection's frames)."""


class InvalidArgument(QflowError):
    """The broker's 542: an argument the broker does not take."""


class NotAllowed(QflowError):
    """The broker's 530: the command is not allowed (this user's access
    rules, a built-in exchange, a destination in use)."""


class ConnectionClosed(QflowError):
    """The connection or the session ended.

    Raised by every call waiting on it then, and by every later one.
    ``code`` and ``text`` say why: the broker's reason when it closed the
    connection, or the client's (``connection lost: ...``, ``connection
    closed by the client``).
    """


class TlsError(ConnectionClosed):
    """TLS with the broker failed.

    Either the broker's certificate could not be verified (an unknown CA, a
    host name it does not name), or the broker refused this client's (none,
    or one it does not trust). ``text`` names the broker's address and the
    reason, in one line; ``__cause__`` is the ssl error.
    """


class FlowControlTimeout(QflowError):
    """A send waited longer than its sender's ``flow_timeout`` for room: the
    message was not sent, and the session stays usable."""


_BY_CODE = {P.NOT_FOUND: NotFound, P.RESOURCE_LOCKED: ResourceLocked, P.PRECONDITION_FAILED: PreconditionFailed,
            P.RESOURCE_LIMIT_EXCEEDED: ResourceLimitExceeded, P.INVALID_ARGUMENT: InvalidArgument,
            P.NOT_ALLOWED: NotAllowed}


def error_for(code: int, text: str) -> QflowError:
    """The exception for a broker error.

    Args:
      code: the broker's error code.
      text: its explanation.

    Returns:
      The error of the type for ``code`` (QflowError for a code without a type of its own).
    """
    return _BY_CODE.get(code, QflowError)(code, text)
