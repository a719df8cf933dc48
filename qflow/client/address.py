"""Broker addresses: the host and port of a qflowd, as people write them.

    >>> parse_address("broker.example:5673")
    ('broker.example', 5673)
    >>> parse_address("[::1]")
    ('::1', 5672)

Every client of qflow that takes an address from a person parses it here:
the command-line tools (after the scheme and credentials of their ``-b``)
and the Spark source (its ``broker`` option). Each words its own refusals
from :attr:`AddressError.problem`.
"""

from __future__ import annotations

import re

DEFAULT_PORT = 5672

# Characters that are never part of a host name or an IP address (with or
# without a zone): mostly a URL's delimiters, here credentials or a path in the
# wrong place.
_NOT_IN_HOST = re.compile(r"[\[\]/@\s]")


class AddressError(ValueError):
    """A broker address that :func:`parse_address` refuses.

    Its message says what is wrong, naming the address. A caller that words
    its own message reads the attributes.

    Attributes:
      address: the text as given.
      problem: what is wrong: ``"empty"`` (no address at all), ``"brackets"``
        (a ``[`` without its ``]``, or something other than ``:PORT`` after
        it), ``"ipv6"`` (several colons outside brackets), ``"no host"``
        (nothing before the colon, or between the brackets), ``"host"`` (a
        host with a character no host has: ``[``, ``]``, ``/`` or ``@``),
        ``"port"`` (a port that is not a number) or ``"range"`` (a port
        outside 1..65535).
      host: the host's text, as far as it was read.
      port: the port's text, for ``"port"`` and ``"range"`` (else empty).
    """

    def __init__(self, address: str, problem: str, message: str, host: str = "", port: str = "") -> None:
        super().__init__(message)
        self.address = address
        self.problem = problem
        self.host = host
        self.port = port


def parse_address(text: str, default_port: int = DEFAULT_PORT, *, default_host: str | None = None
                  ) -> tuple[str, int]:
    """The ``(host, port)`` of a broker address.

    The address is ``HOST:PORT``, ``HOST``, or ``[ADDRESS]:PORT`` and
    ``[ADDRESS]`` for an IPv6 address (the brackets keep its colons apart
    from the port's); surrounding white space is ignored. Without a port it
    is ``default_port``. A scheme, credentials or a path around the address
    are the caller's to take off first: this refuses them rather than take
    them for part of the host.

    Args:
      text: the address.
      default_port: the port of an address that gives none.
      default_host: the host of an address that gives none (``:PORT``, or an
        empty address); None: such an address is refused.

    Returns:
      The host (an IPv6 address without its brackets) and the port, 1..65535.

    Raises:
      AddressError: if ``text`` is not such an address; its ``problem`` says why.
    """
    stripped = text.strip()
    if not stripped:
        if default_host is None:
            raise AddressError(text, "empty", "empty broker address: expected HOST:PORT")
        return default_host, default_port
    if stripped.startswith("["):
        host, bracket, rest = stripped[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise AddressError(text, "brackets", f"broker address {text!r} is not [ADDRESS]:PORT", host)
        if not host:
            raise AddressError(text, "no host", f"broker address {text!r} has no address between its brackets")
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text = stripped.partition(":")
        if ":" in port_text:
            raise AddressError(text, "ipv6", f"broker address {text!r}: write an IPv6 address as [ADDRESS]:PORT",
                               host)
        if not host:
            if default_host is None:
                raise AddressError(text, "no host", f"broker address {text!r} has no host")
            host = default_host
        port_text = port_text if colon else None
    if _NOT_IN_HOST.search(host):
        raise AddressError(text, "host", f"broker address {text!r}: {host!r} is not a host name or address", host)
    if port_text is None:
        return host, default_port
    if not (port_text.isascii() and port_text.isdigit()):
        raise AddressError(text, "port", f"broker address {text!r}: port {port_text!r} is not a number", host,
                           port_text)
    port = int(port_text)
    if not 0 < port < 65536:
        raise AddressError(text, "range", f"broker address {text!r}: port {port} is not 1..65535", host, port_text)
    return host, port
