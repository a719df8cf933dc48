"""Run ``qflowd`` as a child process: for tests, benchmarks and examples.

``start()`` launches it on free loopback ports and returns once its ready
line (``qflowd ready port=P mgmt-port=M``) has been read; ``Daemon.stop()``
stops that process, by its PID, and nothing else.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO


@dataclass
class Daemon:
    proc: subprocess.Popen
    port: int
    mgmt_port: int
    log_path: str | None = None  # where its stderr goes, if a file

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        if self.log_path is None:
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start(*args: str, env: dict[str, str] | None = None, log: str | None = None,
          timeout: float = 30) -> Daemon:
    """Start qflowd with ``args`` on a free protocol port (and, unless ``args``
    say otherwise, a free management port). Its stderr goes to the file
    ``log``, or nowhere: a pipe nobody reads would fill and block it."""
    stderr: IO | int = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qflow.cli.qflowd", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, **(env or {})},
        )
    finally:
        if log:
            stderr.close()  # type: ignore[union-attr]
    line = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            break
    if not line.startswith("qflowd ready"):
        proc.kill()
        proc.wait()
        detail = open(log).read() if log else ""  # noqa: SIM115
        raise RuntimeError(f"qflowd did not start: {line!r} {detail}")
    fields = dict(item.split("=") for item in line.split()[2:])
    return Daemon(proc, int(fields["port"]), int(fields["mgmt-port"]), log)
