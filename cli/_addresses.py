"""The addresses a qflow tool is given: the broker's messaging address
(``-b``, Qpid's ``[amqps://][USER/PASSWORD@]HOST[:PORT]``) and the
management API's (``--mgmt-url``), read into :class:`BrokerUrl` and
:class:`MgmtUrl`.
"""

from __future__ import annotations

import argparse
import re
from typing import Any, NamedTuple

from qflow.client import address as client_address

DEFAULT_BROKER = "localhost:5672"
DEFAULT_MGMT_PORT = 8672
DEFAULT_TLS_PORT = 5671  # amqps://, as Qpid's and RabbitMQ's


class BrokerUrl(NamedTuple):
    """A broker address as Qpid writes it: ``[amqps://][USER/PASSWORD@]HOST[:PORT]``."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None
    tls: bool = False  # amqps://: the broker's TLS port (qflowd --ssl-port)

    @property
    def credentials(self) -> dict[str, Any]:
        """The keyword arguments of qflow.connect that authenticate (none without a user)."""
        return {} if self.username is None else {"username": self.username, "password": self.password}


# Schemes a broker address may carry: the plain protocol, or TLS (Qpid's amqps:// and its older ssl:).
_PLAIN_SCHEMES = ("amqp", "tcp", "qflow")
_TLS_SCHEMES = ("amqps", "ssl", "tls", "qflows")


def parse_url(text: str, default_port: int = 5672) -> BrokerUrl:
    """A broker address as every tool takes it: Qpid's
    ``[amqp://][USER/PASSWORD@]HOST[:PORT]``, or ``amqps://...`` for TLS.

    The host and port are :func:`parse_address`'s. The password may hold '/'
    or '@'; the user name neither. Nothing is silently dropped: any other
    scheme is refused (``http://`` is the management API's: ``--mgmt-url``).

    Args:
      text: the address, as given to ``-b``.
      default_port: the port of an address that gives none; with a TLS
        scheme, 5672 there stands for 5671.

    Raises:
      argparse.ArgumentTypeError: naming what is wrong with the address.
    """
    text = text.strip()
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)(?:://|:tcp:|:ssl:)", text)
    tls = False
    if m:
        scheme = m.group(1).lower()
        tls = scheme in _TLS_SCHEMES or text[m.end(1):].lower().startswith(":ssl:")
        if tls:
            default_port = DEFAULT_TLS_PORT if default_port == 5672 else default_port
        elif scheme not in _PLAIN_SCHEMES:
            hint = "; the management API's URL goes in --mgmt-url" if scheme.startswith("http") else ""
            raise argparse.ArgumentTypeError(f"bad broker address {text!r}: scheme {scheme!r} is not a broker's "
                                             f"(expected [amqp://][USER/PASSWORD@]HOST[:PORT]){hint}")
        text = text[m.end():]
    userinfo, at, hostport = text.rpartition("@")
    host, port = parse_address(hostport, default_port)
    if not at:
        return BrokerUrl(host, port, tls=tls)
    user, slash, password = userinfo.partition("/")
    if not slash or not user:
        raise argparse.ArgumentTypeError(f"bad credentials in broker address: expected USER/PASSWORD@HOST:PORT, "
                                         f"got {userinfo.partition('/')[0]!r}/...@")
    return BrokerUrl(host, port, user, password, tls)


def parse_address(text: str, default_port: int) -> tuple[str, int]:
    """The host and port of a tool's address, with no scheme and no credentials.

    ``HOST:PORT``, ``HOST``, ``:PORT`` (localhost), ``[IPV6]:PORT``, or
    nothing (localhost and ``default_port``), as
    :func:`qflow.client.address.parse_address` reads them; a URL's trailing
    ``/`` is dropped first.

    Args:
      text: the address after its scheme and credentials.
      default_port: the port of an address that gives none.

    Raises:
      argparse.ArgumentTypeError: ``bad port`` for a port outside
        1..65535; ``bad broker address`` for anything else wrong.
    """
    text = text.strip().rstrip("/")
    try:
        return client_address.parse_address(text, default_port, default_host="localhost")
    except client_address.AddressError as exc:
        if exc.problem == "range":
            raise argparse.ArgumentTypeError(f"bad port {int(exc.port)} in {text!r}") from None
        raise argparse.ArgumentTypeError(f"bad broker address {text!r}: expected HOST:PORT") from None


def broker_address(parser: argparse.ArgumentParser, text: str, default_port: int = 5672) -> BrokerUrl:
    """``parse_url``, or the usage error (exit 2) that names the bad address."""
    try:
        return parse_url(text, default_port)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
        raise  # parser.error exits; this keeps type checkers content


class MgmtUrl(NamedTuple):
    """Where the management API is: ``scheme`` http or https."""

    host: str
    port: int
    scheme: str = "http"


def mgmt_address(parser: argparse.ArgumentParser, text: str) -> MgmtUrl:
    """``--mgmt-url``: ``[http://|https://]HOST:PORT`` of the management API."""
    m = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", text.strip())
    rest = text.strip()
    scheme = "http"
    if m:
        scheme = m.group(1).lower()
        if scheme not in ("http", "https"):
            parser.error(f"bad --mgmt-url {text!r}: the management API is http:// or https://")
        rest = rest[m.end():]
    try:
        return MgmtUrl(*parse_address(rest, DEFAULT_MGMT_PORT), scheme)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"bad --mgmt-url: {exc}")
        raise
