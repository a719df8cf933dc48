"""Which HTTP requests the management API may answer at all, whatever the
authentication setting: the defence against web pages driving it.

A browser lets any page it shows send requests to 127.0.0.1 or the LAN. Two
attacks follow, and three rules stop them (``RequestGuard.check``):

* **DNS rebinding**: a page at ``evil.example`` re-points that name at the
  broker and then reads and changes it as "same origin". The browser still
  sends ``Host: evil.example``. Rule: the Host must be one of the broker's
  own names or addresses (localhost, the loopback addresses, the listening
  address, the machine's hostname, the address the connection came in on)
  or a name the operator allowed (``--mgmt-allowed-host``); otherwise
  **421 Misdirected Request**, for every method, GETs included. 421 rather
  than 403: the request is not forbidden to its sender, it is addressed to an
  authority this server does not serve (RFC 9110, 15.5.20).
* **Cross-site requests** (an HTML form or a ``fetch()`` from another
  origin): the browser sends them without asking, with an ``Origin`` header
  and a ``text/plain``, form or multipart body. Rules, for the methods that
  change state (POST, PUT, PATCH, DELETE): an ``Origin`` other than the
  API's own (``http://`` or ``https://`` followed by the request's Host) is
  refused with **403**; and the body must be declared ``application/json``
  (a page can only send that type cross-origin after a CORS preflight, which
  this server never approves), else **415**, even when the body is empty.

A request without ``Origin`` (curl, the qflow tools, any non-browser client)
passes the Origin rule. No response carries an ``Access-Control-*`` header,
and an OPTIONS preflight is answered by the API like any unknown method
(405), so a browser never lets a foreign page send or read anything else.

Sans-I/O: ``check`` takes the request's method, target and headers and the
connection's local address, and returns None or a refusal.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from qflow.protocol.names import printable

STATE_CHANGING = frozenset({b"POST", b"PUT", b"PATCH", b"DELETE"})
JSON_MEDIA_TYPE = "application/json"

# The names every broker answers to, whatever it listens on.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})

_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*")
_HOST_HEADER = re.compile(r"(\[[0-9a-f:.]+\]|[^:\[\]]+)(?::(\d{1,5}))?")


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: the HTTP status and a message for the client (and the log)."""

    status: int
    message: str


def normalize_host(name: str) -> str:
    """A host name or address as compared: lower case, no trailing dot, an IPv6
    address without brackets and in its compressed form."""
    name = name.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def allowed_host_problem(name: str) -> str | None:
    """Why ``name`` cannot be given to ``--mgmt-allowed-host``; None when it can.
    A name is a DNS name or an IP address, without a port or scheme (the port
    of a Host header is not compared: a rebinding page can choose it)."""
    host = normalize_host(name)
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if not host or len(host) > 253 or not _HOST_NAME.fullmatch(host):
        return f"{name!r} is not a host name or IP address (give a name such as broker.example.com, no port)"
    return None


def own_host_names(listen_host: str | None = None, extra: Iterable[str] = ()) -> frozenset[str]:
    """The names a broker listening on ``listen_host`` answers to: the loopback
    names, that address (unless a wildcard), this machine's hostname, and ``extra``."""
    names = {*LOOPBACK_NAMES, *extra}
    if listen_host is not None and listen_host not in WILDCARD_ADDRESSES:
        names.add(listen_host)
    hostname = socket.gethostname()
    if hostname:
        names.add(hostname)
    return frozenset(normalize_host(n) for n in names)


class RequestGuard:
    """The Host, Origin and Content-Type rules of this module.

    ``allowed_hosts`` are the operator's ``--mgmt-allowed-host`` names; the
    broker's own names are added by ``listen_on`` once its address is known.
    """

    def __init__(self, allowed_hosts: Iterable[str] = ()) -> None:
        self.allowed_hosts = tuple(allowed_hosts)
        self.hosts = own_host_names(None, self.allowed_hosts)

    def listen_on(self, host: str) -> None:
        """Also answer to the address the server listens on."""
        self.hosts = own_host_names(host, self.allowed_hosts)

    def check(self, method: bytes, headers: Iterable[tuple[bytes, bytes]], local_address: str | None = None,
              target: bytes = b"") -> Refusal | None:
        """None if the request may go on to the API, else why not. ``headers``
        as h11 gives them (names lower-case); ``local_address`` is the address
        the connection was accepted on (its Host may be that address);
        ``target``: the request target, whose authority, in absolute form
        (``http://host/path``, as sent to a proxy), must be one of the broker's
        names as a Host must (RFC 9112 3.2.2: it stands in for the Host)."""
        m = _ABSOLUTE_FORM.match(target)
        if m is not None:
            authority = m.group(1).decode("latin-1")
            refusal = self._check_host(authority, local_address)
            if refusal is not None:
                return Refusal(421, f"request target for host '{printable(authority)}', which is not a name of "
                                    "this broker; allow it with --mgmt-allowed-host if it is one")
        host = origin = content_type = None
        for key, value in headers:
            if key == b"host":
                host = value.decode("latin-1")
            elif key == b"origin":
                origin = value.decode("latin-1")
            elif key == b"content-type":
                content_type = value.decode("latin-1")
        if host is not None:
            refusal = self._check_host(host, local_address)
            if refusal is not None:
                return refusal
        # Without a Host (HTTP/1.0 only: h11 requires one in 1.1) no browser sent it.
        if method not in STATE_CHANGING:
            return None
        if origin is not None and not _same_origin(origin, host):
            return Refusal(403, f"cross-origin request refused: Origin '{printable(origin)}' is not this "
                                "management API's own origin")
        if content_type is None or content_type.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
            got = "none" if content_type is None else f"'{printable(content_type)}'"
            return Refusal(415, f"a {method.decode('ascii', 'replace')} request must have Content-Type: "
                                f"{JSON_MEDIA_TYPE} (got {got}), even with an empty body")
        return None

    def _check_host(self, host: str, local_address: str | None) -> Refusal | None:
        m = _HOST_HEADER.fullmatch(host.strip())
        name = normalize_host(m.group(1)) if m else None
        if name is not None and (name in self.hosts or (local_address is not None
                                                          and name == normalize_host(local_address))):
            return None
        return Refusal(421, f"Host '{printable(host)}' is not a name of this broker; allow it with "
                            "--mgmt-allowed-host if it is one")


_ABSOLUTE_FORM = re.compile(rb"(?i)[a-z][a-z0-9+.-]*://([^/?#]*)")


def _same_origin(origin: str, host: str | None) -> bool:
    """Is ``origin`` the API's own: http(s):// and the request's Host, port included."""
    if host is None:
        return False
    scheme, sep, authority = origin.strip().lower().partition("://")
    return bool(sep) and scheme in ("http", "https") and authority == host.strip().lower()
