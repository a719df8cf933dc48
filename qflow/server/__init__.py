"""qflowd's network side: the sans-I/O pump that takes one connection's bytes
through the protocol core into the broker (pump.py), the trio task that serves
each connection with one (connection.py), the listener, and the daemon that
composes broker, listener and management server."""

from qflow.server.connection import Connection
from qflow.server.listener import Server
from qflow.server.pump import ConnectionPump

__all__ = ["Connection", "ConnectionPump", "Server"]
