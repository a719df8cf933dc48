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
``pacing`` (rate limits), ``address`` (a broker's HOST:PORT, for every client:
the tools and Spark). The protocol's rules are qflow.protocol's.

The names below load their module on first use, not at ``import qflow.client``:
a tool that only parses an address does not load trio and the whole client.

Their imports run one way, connection -> session -> sender and receiver ->
message: a module calls down into the objects it makes, and knows the one
above it only as a small protocol it defines itself (``SessionConnection``,
``SenderSession``, ``ReceiverSession``, ``Settler``). The methods a module
calls on the one below (``on_completed``, ``wake``, ...) are documented, but
they are the client's own: applications do not need them.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it
_EXPORTS = {
    **dict.fromkeys(("Connection", "connect", "open_connection", "tls_context"), "qflow.client.connection"),
    **dict.fromkeys(("ConnectionClosed", "FlowControlTimeout", "InvalidArgument", "NotAllowed", "NotFound",
                     "PreconditionFailed", "QflowError", "ResourceLimitExceeded", "ResourceLocked", "TlsError",
                     "error_for"), "qflow.client.errors"),
    "ReceivedMessage": "qflow.client.message",
    **dict.fromkeys(("Empty", "Receiver"), "qflow.client.receiver"),
    "Sender": "qflow.client.sender",
    "Session": "qflow.client.session",
    **dict.fromkeys(("AddressError", "parse_address"), "qflow.client.address"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qflow.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
