"""What the qflow tools print: tables as the Qpid tools print them, short
sizes and durations, JSON for scripts, and progress bars on a terminal.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Container, Iterable, Sequence
from typing import Any


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


def print_json(value: Any) -> None:
    """--json: the management API's answer as it is, indented, for scripts (jq)."""
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")


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
