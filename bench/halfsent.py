"""What a half-sent frame costs qflowd: ``python bench/halfsent.py``.

Starts a qflowd, opens ``--connections`` raw connections (header, open,
attach), measures its resident set, then has each send the first half of
one transfer frame of ``--frame-size`` bytes and stop there, and measures
again. Reported per connection: the resident set an open idle connection
costs, and what half a frame adds to it, as a ratio of the bytes held
(1.0: the broker holds each pending byte once).

    python bench/halfsent.py [--connections 200] [--frame-size 1000000 ...]

The broker has read the bytes when its resident set stops growing: this
waits for that (a benchmark, not a test: it may wait on time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qflow import protocol as P  # noqa: E402
from qflow.protocol.framing import PROTOCOL_HEADER  # noqa: E402
from qflow.testing import start  # noqa: E402

KIB = 1024


def rss_kib(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1))


def settled_rss(pid: int, quiet: float = 1.0, timeout: float = 60.0) -> int:
    """The resident set once it has not changed for ``quiet`` seconds."""
    last, since = rss_kib(pid), time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = rss_kib(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def measure(connections: int, frame_size: int, extra: list[str]) -> dict:
    d = start("--no-data-dir", "--max-connections", str(connections + 10), *extra)
    socks: list[socket.socket] = []
    try:
        base = settled_rss(d.proc.pid)
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", d.port))
            s.sendall(PROTOCOL_HEADER + msgpack.packb([P.OPEN, {}]) + msgpack.packb([P.ATTACH, 0, "half"]))
            socks.append(s)
        opened = settled_rss(d.proc.pid)
        body = os.urandom(frame_size)  # random: no page the kernel could share
        frame = msgpack.packb([P.TRANSFER, 0, "", "q", None, body])
        half = frame[: len(frame) // 2]
        for s in socks:
            s.sendall(half)
        held = settled_rss(d.proc.pid)
        alive = d.proc.poll() is None
        per_conn = (opened - base) / connections
        per_half = (held - opened) / connections
        return {"connections": connections, "frame_size": frame_size, "half_kib": len(half) / KIB,
                "idle_conn_kib": round(per_conn, 1), "half_frame_kib": round(per_half, 1),
                "held_ratio": round(per_half * KIB / len(half), 2), "total_per_conn_kib": round(per_conn + per_half, 1),
                "broker_alive": alive}
    finally:
        for s in socks:
            s.close()
        d.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--frame-size", type=int, nargs="+", default=[2000, 200_000, 1_000_000])
    ap.add_argument("--qflowd-arg", action="append", default=[], help="passed on to qflowd (repeatable)")
    args = ap.parse_args()
    results = []
    for size in args.frame_size:
        r = measure(args.connections, size, args.qflowd_arg)
        results.append(r)
        print(f"{size:>9} B frames, half sent on {r['connections']} connections: idle connection "
              f"{r['idle_conn_kib']} KiB, half frame ({r['half_kib']:.0f} KiB) adds {r['half_frame_kib']} KiB "
              f"(x{r['held_ratio']} its bytes), {r['total_per_conn_kib']} KiB per connection", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
