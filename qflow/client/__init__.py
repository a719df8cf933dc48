"""The trio client: connections, sessions, senders with a capacity, receivers
with credit.

    async with qflow.open_connection("127.0.0.1", 5672) as conn:
        ssn = await conn.session()
        await ssn.declare_queue("orders")
        sender = ssn.sender("orders", capacity=100)
        await sender.send(b"hello")
        await sender.sync()

A sender's *capacity* is the number of its transfers that may be incomplete;
``send`` waits while that many are outstanding. The broker holds completions
back while a destination queue's flow is stopped, so a sender stops after at
most ``capacity`` transfers: that is producer flow control.

One module per concept: ``connection`` (open_connection, connect), ``session``,
``sender``, ``receiver``, ``message`` (what a receiver hands out), ``errors``,
``pacing`` (rate limits). The protocol's rules are qflow.protocol's.

Their imports run one way, connection -> session -> sender and receiver ->
message: a module calls down into the objects it makes, and knows the one
above it only as a small protocol it defines itself (``SessionConnection``,
``SenderSession``, ``ReceiverSession``, ``Settler``). The methods a module
calls on the one below (``on_completed``, ``wake``, ...) are documented, but
they are the client's own: applications do not need them.
"""

from qflow.client.connection import Connection, connect, open_connection, tls_context
from qflow.client.errors import (
    ConnectionClosed,
    FlowControlTimeout,
    InvalidArgument,
    NotAllowed,
    NotFound,
    PreconditionFailed,
    QflowError,
    ResourceLimitExceeded,
    ResourceLocked,
    TlsError,
    error_for,
)
from qflow.client.message import ReceivedMessage
from qflow.client.receiver import Empty, Receiver
from qflow.client.sender import Sender
from qflow.client.session import Session

__all__ = [
    "Connection", "ConnectionClosed", "Empty", "FlowControlTimeout", "InvalidArgument", "NotAllowed", "NotFound",
    "PreconditionFailed", "QflowError", "ReceivedMessage", "Receiver", "ResourceLimitExceeded", "ResourceLocked",
    "Sender", "Session", "TlsError", "connect", "error_for", "open_connection", "tls_context",
]
