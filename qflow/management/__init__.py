"""qflowd's management HTTP API (JSON) and its Prometheus metrics: thin views
over the live broker, served with h11 on trio.

- ``views``: what monitoring shows, one function per view (broker, queue,
  exchange, binding, connection and session), built from the live objects.
- ``api``: the JSON routes (sans-I/O): request -> view or change -> response.
- ``metrics``: the Prometheus text, rendered from the same views.
- ``guard``: which requests may reach the API at all (Host, Origin,
  Content-Type): what keeps web pages from driving it.
- ``http``: the h11 server on trio: limits, timeouts, keep-alive.

This package imports qflow.protocol and qflow.broker only; the protocol
server is handed in as an argument.
"""

from qflow.management.api import ManagementApi
from qflow.management.guard import RequestGuard
from qflow.management.http import DEFAULT_PORT, DEFAULT_TIMEOUT, MAX_BODY, ManagementServer

__all__ = ["DEFAULT_PORT", "DEFAULT_TIMEOUT", "MAX_BODY", "ManagementApi", "ManagementServer", "RequestGuard"]
