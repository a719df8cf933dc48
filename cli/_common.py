"""What the qflow command-line tools share: broker addresses, the management
HTTP client, tables, progress bars, and the exit-code conventions.

Exit codes, as in the Qpid tools: 0 success, 1 the broker (or the network)
refused, 2 a usage error (argparse's own).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import re
import socket
import ssl
import sys
from collections.abc import Container, Iterable, Sequence
from typing import Any, NamedTuple
from urllib.parse import quote

from qflow.client import address as client_address

DEFAULT_MGMT_PORT = 8672
DEFAULT_BROKER = "localhost:5672"
DEFAULT_TLS_PORT = 5671  # amqps://, as Qpid's and RabbitMQ's


class ToolError(Exception):
    """A refusal to report on stderr with exit status 1."""


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


def add_tls_options(p: argparse.ArgumentParser, management: bool = False) -> None:
    """The TLS and SASL options, with the qpid tools' names (their aliases in
    qflowd's spelling): the CA that signs the broker's certificate, this
    client's own certificate and key (mutual TLS), and the mechanism."""
    where = "the broker's TLS port (amqps://) and https management API" if management else \
        "the broker's TLS port (amqps://)"
    p.add_argument("--ssl-trustfile", "--ssl-ca-file", dest="ssl_trustfile", metavar="FILE",
                   help=f"CA certificates (PEM) that sign {where}'s certificate (default: the system's); its "
                        "host name is checked against the one in -b")
    p.add_argument("--ssl-certificate", "--ssl-cert-file", dest="ssl_certificate", metavar="FILE",
                   help="this client's certificate (PEM), for a broker that asks for one (mutual TLS); without a "
                        "user in -b, it authenticates as the certificate's name (EXTERNAL)")
    p.add_argument("--ssl-key", "--ssl-key-file", dest="ssl_key", metavar="FILE",
                   help="the private key (PEM) of --ssl-certificate, if not in that file")
    p.add_argument("--sasl-mechanism", choices=("SCRAM-SHA-256", "PLAIN", "EXTERNAL", "ANONYMOUS"), default=None,
                   metavar="MECH", help="SCRAM-SHA-256 (the default with a user), PLAIN, EXTERNAL (the default with "
                                        "--ssl-certificate and no user) or ANONYMOUS")


def check_tls_options(parser: argparse.ArgumentParser, args: argparse.Namespace, url: BrokerUrl,
                      management: bool = False) -> None:
    """Usage errors (exit 2) of the TLS options, before anything is sent."""
    if args.ssl_key and not args.ssl_certificate:
        parser.error("--ssl-key needs --ssl-certificate")
    given = next((name for name, value in (("--ssl-trustfile", args.ssl_trustfile),
                                           ("--ssl-certificate", args.ssl_certificate)) if value), None)
    if given and not url.tls and not management:
        parser.error(f"{given} is for TLS: give the broker's TLS address, amqps://HOST:PORT")
    mechanism = args.sasl_mechanism
    if mechanism == "EXTERNAL" and (url.username is not None or not args.ssl_certificate or
                                    not (url.tls or management)):
        parser.error("--sasl-mechanism EXTERNAL takes no user in -b, and needs --ssl-certificate and a TLS "
                     "address (amqps://)")
    if mechanism in ("SCRAM-SHA-256", "PLAIN") and url.username is None:
        parser.error(f"--sasl-mechanism {mechanism} needs a user: -b USER/PASSWORD@HOST:PORT")
    if mechanism == "ANONYMOUS" and url.username is not None:
        parser.error("--sasl-mechanism ANONYMOUS takes no user in -b")


def client_tls(args: argparse.Namespace) -> ssl.SSLContext:
    """The TLS context of the tool's options (qflow.client.tls_context).
    Raises ToolError naming the option whose file cannot be used."""
    from qflow.client.connection import tls_context

    try:
        context = tls_context(ca_file=args.ssl_trustfile)
    except (OSError, ssl.SSLError) as exc:
        raise ToolError(f"cannot load --ssl-trustfile {args.ssl_trustfile}: "
                        f"{getattr(exc, 'strerror', None) or exc}") from None
    if args.ssl_certificate:
        try:
            context.load_cert_chain(args.ssl_certificate, args.ssl_key)
        except (OSError, ssl.SSLError) as exc:
            what = f"--ssl-certificate {args.ssl_certificate}" + (f" / --ssl-key {args.ssl_key}"
                                                                  if args.ssl_key else "")
            raise ToolError(f"cannot load {what}: {getattr(exc, 'strerror', None) or exc}") from None
    return context


def connect_options(args: argparse.Namespace, url: BrokerUrl) -> dict[str, Any]:
    """qflow.connect's keyword arguments for ``url`` and the tool's TLS and
    SASL options: credentials, mechanism, ssl_context. Raises ToolError."""
    options = dict(url.credentials)
    mechanism = args.sasl_mechanism
    if mechanism is None and url.username is None and args.ssl_certificate and url.tls:
        mechanism = "EXTERNAL"  # as qpid's clients do with a certificate and no user
    if mechanism is not None:
        options["mechanism"] = mechanism
    if url.tls:
        options["ssl_context"] = client_tls(args)
    return options


def _tls_failure(what: str, exc: OSError) -> ToolError:
    from qflow.transport.tls import client_handshake_failure

    return ToolError(f"TLS with {what} failed: {client_handshake_failure(exc)}")


def discover_management(url: BrokerUrl, timeout: float, name: str,
                        args: argparse.Namespace | None = None) -> MgmtUrl:
    """Ask the broker at ``url`` (its messaging port) for its management
    address: qflowd announces ``management_port`` (and ``management_scheme``,
    https when it serves TLS) in ``connection.open-ok``, and the management
    API listens on the same host. A blocking handshake through the
    protocol's own sans-I/O state machine (over TLS for amqps://, with the
    TLS options of ``args``), closed at once."""
    from qflow.protocol import spec as P
    from qflow.protocol.connection import ConnectionEnd, Opened, ProtocolConnection, Role
    from qflow.protocol.framing import FramingError

    address = f"{url.host}:{url.port}"
    options = connect_options(args, url) if args is not None else dict(url.credentials)
    context = options.pop("ssl_context", None)
    protocol = ProtocolConnection(Role.CLIENT, name=name, username=options.get("username"),
                                  password=options.get("password") or "", mechanism=options.get("mechanism"),
                                  probe=True)  # the broker logs a probe at debug: one per tool run is noise
    try:
        sock = socket.create_connection((url.host, url.port), timeout=timeout)
    except OSError as exc:
        reason = "timed out" if isinstance(exc, socket.timeout) else exc.strerror or str(exc)
        raise ToolError(f"cannot reach the broker at {address}: {reason}") from None
    if context is not None:
        try:
            sock = context.wrap_socket(sock, server_hostname=url.host)
        except ssl.SSLError as exc:
            sock.close()
            raise _tls_failure(f"the broker at {address}", exc) from None
        except OSError as exc:
            sock.close()
            reason = "timed out" if isinstance(exc, socket.timeout) else exc.strerror or str(exc)
            raise ToolError(f"cannot reach the broker at {address}: {reason}") from None
    with sock:
        try:
            sock.sendall(protocol.encoder.take())
            while True:
                out = protocol.encoder.take()  # a SASL response, when the broker authenticates
                if out:
                    sock.sendall(out)
                protocol.receive_data(sock.recv(65536), 0.0)
                for frame in protocol.decoder.frames():
                    if isinstance(protocol.receive_control(frame), Opened):
                        port = protocol.peer_properties.get("management_port")
                        scheme = protocol.peer_properties.get("management_scheme", "http")
                        protocol.close(P.NORMAL, "management address learnt")
                        protocol.write_close()
                        sock.sendall(protocol.encoder.take())
                        if type(port) is not int or not 0 < port < 65536 or scheme not in ("http", "https"):
                            raise ToolError(f"the broker at {address} did not announce its management port; "
                                            "give it with --mgmt-url HOST:PORT")
                        return MgmtUrl(url.host, port, scheme)
        except ConnectionEnd as exc:
            if context is not None and exc.stream_ended:  # no close frame: TLS ended
                from qflow.transport.tls import PEER_ENDED_HINT

                raise ToolError(f"TLS with the broker at {address} failed: connection closed ({PEER_ENDED_HINT})") \
                    from None
            raise ToolError(f"the broker at {address} refused the connection: {exc.text}") from None
        except ssl.SSLError as exc:  # TLS 1.3: the broker refuses this client's certificate after the handshake
            raise _tls_failure(f"the broker at {address}", exc) from None
        except ConnectionResetError as exc:
            if context is not None:  # the same refusal, when the broker closed with our open unread
                raise _tls_failure(f"the broker at {address}", exc) from None
            raise ToolError(f"cannot reach the broker at {address}: {exc.strerror or exc}") from None
        except FramingError as exc:
            raise ToolError(f"{address} does not speak qflow's protocol ({exc}); -b takes the broker's "
                            "messaging address (port 5672 by default)") from None
        except OSError as exc:
            reason = "timed out" if isinstance(exc, socket.timeout) else exc.strerror or str(exc)
            raise ToolError(f"cannot reach the broker at {address}: {reason}") from None


def add_address_options(p: argparse.ArgumentParser) -> None:
    """-b, --mgmt-url and the TLS options, the same on every management tool."""
    p.add_argument("-b", "--broker", "-a", "--broker-addr", dest="broker", default=DEFAULT_BROKER,
                   metavar="[amqps://][USER/PASS@]HOST[:PORT]",
                   help=f"the broker's address, the same as qflow-send's (default {DEFAULT_BROKER}), with the "
                        "credentials of a user when it runs --auth yes; the management API is found from it")
    p.add_argument("--mgmt-url", metavar="[http[s]://]HOST:PORT",
                   help="the management API's address, if it cannot be found from -b (qflowd --mgmt-port)")
    add_tls_options(p, management=True)


def open_management(parser: argparse.ArgumentParser, args: argparse.Namespace, prog: str) -> Management:
    """The management client of ``args``: --mgmt-url, else the address the broker at -b announces.
    Raises ToolError when the broker cannot be asked."""
    url = broker_address(parser, args.broker)  # its credentials go to the management API too (HTTP Basic)
    check_tls_options(parser, args, url, management=True)
    if args.mgmt_url:
        where = mgmt_address(parser, args.mgmt_url)
    else:
        where = discover_management(url, args.timeout, f"{prog}[{os.getpid()}]", args)
    context = client_tls(args) if where.scheme == "https" else None
    return Management(where.host, where.port, args.timeout, url.username, url.password, context)


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive(text: str) -> int:
    value = non_negative(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value < 1e9:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def seconds_or_zero(text: str) -> float:
    """A number of seconds, where 0 means "no limit", as in Qpid's tools."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < 1e9:
        raise argparse.ArgumentTypeError(f"must be 0 (no limit) or more, got {text}")
    return value


def yes_no(text: str) -> bool:
    low = text.lower()
    if low in ("yes", "true", "1", "y"):
        return True
    if low in ("no", "false", "0", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")


def fail(prog: str, message: str) -> int:
    sys.stderr.write(f"{prog}: {message}\n")
    return 1


class Management:
    """A keep-alive client for qflowd's management API (qflow.management)."""

    def __init__(self, host: str, port: int, timeout: float = 10.0, username: str | None = None,
                 password: str | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        """``username`` and ``password``: sent as HTTP Basic (a broker with ``--auth yes`` needs them);
        ``ssl_context``: https (the broker's certificate and host name verified with it)."""
        self.address = f"{host}:{port}"
        self._https = ssl_context is not None
        self._conn: http.client.HTTPConnection = (
            http.client.HTTPConnection(host, port, timeout=timeout) if ssl_context is None
            else http.client.HTTPSConnection(host, port, timeout=timeout, context=ssl_context))
        self._auth: dict[str, str] = {}
        if username is not None:
            token = base64.b64encode(f"{username}:{password or ''}".encode()).decode("ascii")
            self._auth = {"Authorization": f"Basic {token}"}

    def close(self) -> None:
        self._conn.close()

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """The decoded JSON answer; raises ToolError with the broker's message
        for a 4xx/5xx, or a one-line reason when the broker cannot be reached."""
        data = None if body is None else json.dumps(body).encode()
        # qflowd refuses a state-changing request not declared JSON, even with no body (what keeps web
        # pages' forms out: qflow.management.guard).
        headers = {"Content-Type": "application/json"} if data is not None or method != "GET" else {}
        headers.update(self._auth)
        for attempt in (1, 2):
            try:
                self._conn.request(method, path, body=data, headers=headers)
                response = self._conn.getresponse()
                payload = response.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # The server closed an idle keep-alive connection: one fresh try.
                self._conn.close()
                if attempt == 2 and self._https:
                    from qflow.transport.tls import PEER_ENDED_HINT

                    raise ToolError(f"TLS with the broker's management API at {self.address} failed: connection "
                                    f"closed ({PEER_ENDED_HINT})") from None
                if attempt == 2:
                    raise ToolError(f"management connection to {self.address} closed unexpectedly (if the "
                                    "broker serves https there, say --mgmt-url https://...)") from None
            except http.client.BadStatusLine as exc:
                self._conn.close()
                if "QFLOW" in str(exc):
                    raise ToolError(f"{self.address} is qflowd's messaging port, not its management API: "
                                    "--mgmt-url takes the management port (8672 by default), or leave it "
                                    "out and give the broker's address with -b") from None
                raise ToolError(f"{self.address} does not answer as qflowd's management API ({exc!r:.60})") \
                    from None
            except ssl.SSLError as exc:
                self._conn.close()
                raise _tls_failure(f"the broker's management API at {self.address}", exc) from None
            except (OSError, http.client.HTTPException) as exc:
                self._conn.close()
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
                if isinstance(exc, socket.timeout):
                    reason = "timed out"
                raise ToolError(f"cannot reach the broker's management API at {self.address}: {reason}") from None
        try:
            value = json.loads(payload) if payload else None
        except ValueError:
            value = None
        if response.status >= 400:
            message = value.get("error") if isinstance(value, dict) else None
            raise ToolError(message or f"HTTP {response.status} {response.reason}")
        return value

    def get(self, path: str) -> Any:
        return self.request("GET", path)


def name_path(prefix: str, name: str, suffix: str = "") -> str:
    """The URL of a named object: every byte of the name percent-encoded but unreserved ones."""
    return f"{prefix}/{quote(name, safe='')}{suffix}"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain-text table as the Qpid tools print them: a header, a rule of
    '=', numbers right-aligned."""
    values = [list(row) for row in rows]
    text_rows = [[_cell(v) for v in row] for row in values]
    widths = [len(h) for h in headers]
    numeric = [True] * len(headers)
    for row, cells in zip(values, text_rows, strict=True):
        for i, (v, cell) in enumerate(zip(row, cells, strict=True)):
            widths[i] = max(widths[i], len(cell))
            if not isinstance(v, int | float) or isinstance(v, bool):
                numeric[i] = False

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if numeric[i] else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                                    strict=True)))

    out = [line(list(headers)).rstrip(), "=" * (sum(widths) + 2 * (len(widths) - 1))]
    out += [line(row).rstrip() for row in text_rows]
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is True:
        return "Y"
    if value is False or value is None:
        return ""
    text = str(value)
    # A queue name may hold control characters: never let one move the cursor.
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def human_bytes(n: int) -> str:
    """A byte count short enough for a table column: 512B, 1.5K, 33.9M, 9.4G (K, M, G, T: powers of 1024)."""
    if n < 1024:
        return f"{n}B"
    value = float(n)
    for unit in "KMGT":
        value /= 1024
        if value < 1024 or unit == "T":
            # Rounding may reach 1024.0 (1048575 bytes): the next unit then says it better.
            if round(value, 1) < 1024 or unit == "T":
                return f"{value:.1f}{unit}"
    return f"{value:.1f}T"


def duration(seconds: float | None) -> str:
    """12s, 3m04s, 2h05m, 3d04h: short enough for a table column."""
    if seconds is None:
        return ""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def interactive() -> bool:
    """Progress bars only for a person watching: stdout and stderr both terminals."""
    return sys.stdout.isatty() and sys.stderr.isatty()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


PROGRESS_MIN = 1000  # messages: shorter runs end before a bar would tell anything


def progress_bar(total: int | None, description: str, enabled: bool) -> Any:
    """A tqdm bar on stderr when ``enabled`` (and a terminal is watching), else a no-op.
    Use it with :func:`bar_logging`, so a log line is printed above it, never over it."""
    if not enabled or not interactive():
        return _NoBar()
    from tqdm import tqdm  # imported only when shown: keeps the tools' start-up quick

    return tqdm(total=total, desc=description, unit="msg", unit_scale=True, leave=False, file=sys.stderr)


def bar_logging(bar: Any) -> Any:
    """A context in which log records (the client's flow-control warnings) are
    written above ``bar`` by tqdm instead of across it."""
    if isinstance(bar, _NoBar):
        return contextlib.nullcontext()
    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm()


def held_text(held_by: dict[str, float], now: float, holders: Container[str] = ()) -> str:
    """"held 12s by orders": the longest flow-control hold of a session
    (``held_by``: queue or holder -> since); a broker-wide holder (``holders``)
    reads "held 12s by the store disk quota"."""
    if not held_by:
        return ""
    name, since = min(held_by.items(), key=lambda item: item[1])
    more = f" (+{len(held_by) - 1})" if len(held_by) > 1 else ""
    return f"held {duration(max(0.0, now - since))} by {'the ' if name in holders else ''}{name}{more}"


def single_error(group: BaseExceptionGroup) -> BaseException:
    """The one exception a nursery's group carries (the group itself if it carries several)."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


async def show_held(bar: Any, held_by: dict[str, float], holders: Container[str] = (), interval: float = 0.5) -> None:
    """Keep ``bar``'s postfix saying how long flow control has held the sender
    (a held sender's count does not move, so the bar itself would look stuck)."""
    import trio

    if isinstance(bar, _NoBar):
        return
    shown = ""
    while True:
        text = held_text(held_by, trio.current_time(), holders)
        if text != shown:
            bar.set_postfix_str(text)
            shown = text
        elif text:
            bar.refresh()
        await trio.sleep(interval)


def add_broker_option(p: argparse.ArgumentParser) -> None:
    """-b/--broker, the broker's protocol address, as qflow-send and qflow-receive take it."""
    p.add_argument("-b", "--broker", default=DEFAULT_BROKER, metavar="[amqps://][USER/PASS@]HOST:PORT",
                   help=f"the broker's protocol address (default {DEFAULT_BROKER}); amqps:// for its TLS port "
                        "(5671 by default)")


def add_connection_options(p: argparse.ArgumentParser, prog: str) -> None:
    """What a tool that opens a messaging connection takes besides -b: its
    connection's name, TLS and SASL, and every tool's --version and completion."""
    p.add_argument("--connection-name", default=f"{prog}[{os.getpid()}]", metavar="NAME",
                   help="the connection's name, shown by qflow-stat -c")
    add_tls_options(p)
    add_tool_options(p)


def client_setup(parser: argparse.ArgumentParser,
                 argv: list[str] | None) -> tuple[argparse.Namespace, BrokerUrl, dict[str, Any]]:
    """A messaging tool's arguments (add_broker_option, add_connection_options):
    (the arguments, the broker's address, the connection's options).

    Raises:
      SystemExit: status 2 through ``parser.error`` for an address or TLS/SASL
        options that do not fit; status 1, with the tool's one-line message,
        for TLS files that cannot be loaded.
    """
    args = parser.parse_args(argv)
    url = broker_address(parser, args.broker, 5672)
    check_tls_options(parser, args, url)
    try:
        return args, url, connect_options(args, url)
    except ToolError as exc:
        sys.exit(fail(parser.prog, str(exc)))


def add_tool_options(p: argparse.ArgumentParser) -> None:
    """What every tool has: --version, and --print-completion SHELL (shtab) to
    write its shell completion script: ``qflow-stat --print-completion bash >
    ~/.local/share/bash-completion/completions/qflow-stat``."""
    import shtab

    from qflow import __version__

    p.add_argument("--version", action="version", version=f"%(prog)s (qflow) {__version__}")
    shtab.add_argument_to(p, "--print-completion", help="print a shell completion script (bash, zsh or tcsh)")


def print_json(value: Any) -> None:
    """--json: the management API's answer as it is, indented, for scripts (jq)."""
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
