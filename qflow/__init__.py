"""qflow: a message broker with Qpid C++-style producer flow control."""

from qflow.accounting import AccountingError, PyAccounting, load_accounting
from qflow.broker import Broker
from qflow.client import (
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
)
from qflow.flow import FlowDefaults, QueueSettings, SettingsError
from qflow.framing import FrameDecoder, FrameEncoder, FramingError
from qflow.ranges import RangeSet

__version__ = "0.1.0"

__all__ = [
    "AccountingError", "Broker", "ConnectionClosed", "Empty", "FlowControlTimeout", "FlowDefaults", "FrameDecoder",
    "FrameEncoder", "FramingError", "InvalidArgument", "NotAllowed", "NotFound", "PreconditionFailed",
    "PyAccounting", "QflowError", "QueueSettings", "RangeSet", "ReceivedMessage", "Receiver",
    "ResourceLimitExceeded", "ResourceLocked", "Sender", "Session", "SettingsError", "connect", "load_accounting",
]
