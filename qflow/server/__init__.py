"""qflowd's network side, trio only: the listener, each connection's task that
pumps bytes between its socket, the protocol core and the broker, and the
daemon that composes broker, listener and management server."""

from qflow.server.connection import Connection
from qflow.server.listener import Server

__all__ = ["Connection", "Server"]
