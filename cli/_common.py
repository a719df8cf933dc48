"""What the qflow command-line tools share: broker addresses, the management
HTTP client, tables, progress bars, and the exit-code conventions.

Exit codes, as in the Qpid tools: 0 success, 1 the broker (or the network)
refused, 2 a usage error (argparse's own).
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import re
import socket
import sys
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple
from urllib.parse import quote

DEFAULT_MGMT = "localhost:8672"
DEFAULT_BROKER = "localhost:5672"


class ToolError(Exception):
    """A refusal to report on stderr with exit status 1."""


class BrokerUrl(NamedTuple):
    """A broker address as Qpid writes it: ``[USER/PASSWORD@]HOST[:PORT]``."""

    host: str
    port: int
    username: str | None = None
    password: str | None = None

    @property
    def credentials(self) -> dict[str, Any]:
        """The keyword arguments of qflow.connect that authenticate (none without a user)."""
        return {} if self.username is None else {"username": self.username, "password": self.password}


def parse_url(text: str, default_port: int) -> BrokerUrl:
    """Qpid's broker URL: ``[amqp://][USER/PASSWORD@]HOST[:PORT]`` (see
    :func:`parse_address` for the host forms). The password may hold '/' or
    '@'; the user name neither."""
    text = re.sub(r"^[a-z][a-z0-9+.-]*://", "", text.strip())
    userinfo, at, _ = text.rpartition("@")
    host, port = parse_address(text, default_port)
    if not at:
        return BrokerUrl(host, port)
    user, slash, password = userinfo.partition("/")
    if not slash or not user:
        raise argparse.ArgumentTypeError(f"bad credentials in broker address: expected USER/PASSWORD@HOST:PORT, "
                                         f"got {userinfo.partition('/')[0]!r}/...@")
    return BrokerUrl(host, port, user, password)


def parse_address(text: str, default_port: int) -> tuple[str, int]:
    """``HOST:PORT``, ``HOST``, ``:PORT`` or ``[IPV6]:PORT``; a Qpid-style
    ``user/password@`` prefix or a URL scheme is skipped (:func:`parse_url` reads them)."""
    text = text.strip()
    text = re.sub(r"^[a-z][a-z0-9+.-]*://", "", text)
    text = text.rsplit("@", 1)[-1].rstrip("/")
    m = re.fullmatch(r"\[([0-9a-fA-F:.]+)\](?::(\d+))?|([^:\[\]]*)(?::(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"bad broker address {text!r}: expected HOST:PORT")
    host = m.group(1) or m.group(3) or "localhost"
    port_text = m.group(2) or m.group(4)
    port = int(port_text) if port_text else default_port
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"bad port {port} in {text!r}")
    return host, port


def broker_address(parser: argparse.ArgumentParser, text: str, default_port: int) -> BrokerUrl:
    """``parse_url``, or the usage error (exit 2) that names the bad address."""
    try:
        return parse_url(text, default_port)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
        raise  # parser.error exits; this keeps type checkers content


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
                 password: str | None = None) -> None:
        """``username`` and ``password``: sent as HTTP Basic (a broker with ``--auth yes`` needs them)."""
        self.address = f"{host}:{port}"
        self._conn = http.client.HTTPConnection(host, port, timeout=timeout)
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
                if attempt == 2:
                    raise ToolError(f"management connection to {self.address} closed unexpectedly") from None
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
    """A tqdm bar on stderr when ``enabled`` (and a terminal is watching), else a no-op."""
    if not enabled or not interactive():
        return _NoBar()
    from tqdm import tqdm  # imported only when shown: keeps the tools' start-up quick

    return tqdm(total=total, desc=description, unit="msg", unit_scale=True, leave=False, file=sys.stderr)
