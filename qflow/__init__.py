"""qflow: a message broker with Qpid C++-style producer flow control.

The public API is re-exported here. The client's names load the client (and
trio) on first use, not at ``import qflow``: ``import qflow.protocol``, the
sans-I/O core, must stay free of trio.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(
        ("ConnectionClosed", "Empty", "FlowControlTimeout", "InvalidArgument", "NotAllowed", "NotFound",
         "PreconditionFailed", "QflowError", "ReceivedMessage", "Receiver", "ResourceLimitExceeded",
         "ResourceLocked", "Sender", "Session", "TlsError", "connect", "open_connection", "tls_context"),
        "qflow.client"),
    **dict.fromkeys(("AccountingError", "PyAccounting", "load_accounting"), "qflow.broker.accounting"),
    "Broker": "qflow.broker",
    **dict.fromkeys(("FlowDefaults", "QueueSettings", "SettingsError"), "qflow.broker.settings"),
    **dict.fromkeys(("FrameDecoder", "FrameEncoder", "FramingError"), "qflow.protocol.framing"),
    "RangeSet": "qflow.protocol.ranges",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
