"""The trio client: connections, sessions, senders with a capacity, receivers
with credit."""

from qflow.client.client import (
    Connection,
    ConnectionClosed,
    Empty,
    FlowControlTimeout,
    InvalidArgument,
    NotAllowed,
    NotFound,
    PreconditionFailed,
    QflowError,
    ReceivedMessage,
    Receiver,
    ResourceLimitExceeded,
    ResourceLocked,
    Sender,
    Session,
    connect,
    error_for,
)

__all__ = [
    "Connection", "ConnectionClosed", "Empty", "FlowControlTimeout", "InvalidArgument", "NotAllowed", "NotFound",
    "PreconditionFailed", "QflowError", "ReceivedMessage", "Receiver", "ResourceLimitExceeded", "ResourceLocked",
    "Sender", "Session", "connect", "error_for",
]
