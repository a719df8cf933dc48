"""The management tools' way to qflowd's management API: its address
(given, or asked of the broker), and :class:`Management`, the HTTP client
that talks to it.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import socket
import ssl
from typing import Any
from urllib.parse import quote

from ._addresses import DEFAULT_BROKER, BrokerUrl, MgmtUrl, broker_address, mgmt_address
from ._errors import ToolError
from ._security import add_tls_options, check_tls_options, client_tls, connect_options, tls_failure


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
            raise tls_failure(f"the broker at {address}", exc) from None
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
            raise tls_failure(f"the broker at {address}", exc) from None
        except ConnectionResetError as exc:
            if context is not None:  # the same refusal, when the broker closed with our open unread
                raise tls_failure(f"the broker at {address}", exc) from None
            raise ToolError(f"cannot reach the broker at {address}: {exc.strerror or exc}") from None
        except FramingError as exc:
            raise ToolError(f"{address} does not speak qflow's protocol ({exc}); -b takes the broker's "
                            "messaging address (port 5672 by default)") from None
        except OSError as exc:
            reason = "timed out" if isinstance(exc, socket.timeout) else exc.strerror or str(exc)
            raise ToolError(f"cannot reach the broker at {address}: {reason}") from None


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
                raise tls_failure(f"the broker's management API at {self.address}", exc) from None
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
