"""What the benchmarks share: a qflowd to measure, the ready/go handshake with
their client processes, a queue declared, a process's CPU time. bench/run.py
and the workloads it runs (bench/latency.py) import it; it imports neither.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import qflow  # noqa: E402
from qflow import testing as qflowd  # noqa: E402

NO_FLOW = {"qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0, "qpid.max_size": 0}


def start_broker(*args: str, env: dict | None = None) -> qflowd.Daemon:
    """A fresh qflowd; its ``stop()`` also removes the temporary data directory start() gave it."""
    return qflowd.start("--log-level", "warning", *args, env=env)


def ready() -> None:
    """Tell the parent this client is connected and set up, then wait for go:
    start-up (imports, connecting) is not part of the measured time."""
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the benchmark parent went away")


def expect(proc: subprocess.Popen, word: str) -> str:
    """The rest of the client's next line, which must start with ``word`` (else the client failed)."""
    line = proc.stdout.readline()
    if not line.startswith(word):
        proc.kill()
        raise SystemExit(f"a benchmark client failed (exit {proc.wait()}) before {word}: {line!r}")
    return line[len(word):].strip()


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` used so far, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def declare(port: int, queue: str, arguments: dict, credentials: dict | None = None,
                  durable: bool = False) -> None:
    """Declare ``queue`` on the qflowd at ``port``."""
    async with await qflow.connect("127.0.0.1", port, **(credentials or {})) as conn:
        ssn = await conn.session()
        await ssn.declare_queue(queue, arguments=arguments, durable=durable)
