"""Shared fixtures: a broker served in-process on a free loopback port, and a
real ``qflowd`` subprocess for the tests that need one."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import trio

import qflow
from qflow.broker import Broker
from qflow.flow import FlowDefaults
from qflow.server import Server


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "native_only: runs once, not again under QFLOW_ACCOUNTING=python")


@dataclass
class Running:
    broker: Broker
    server: Server
    port: int
    host: str = "127.0.0.1"

    async def connect(self, **kwargs) -> qflow.client.Connection:
        return await qflow.connect(self.host, self.port, **kwargs)


async def start_broker(nursery: trio.Nursery, defaults: FlowDefaults | None = None,
                       max_frame_size: int | None = None) -> Running:
    broker = Broker(defaults)
    server = Server(broker, max_frame_size) if max_frame_size else Server(broker)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return Running(broker, server, port)


@pytest.fixture
async def running(nursery: trio.Nursery) -> AsyncIterator[Running]:
    """A broker with default settings, listening on 127.0.0.1 on a free port."""
    yield await start_broker(nursery)


@pytest.fixture
async def conn(running: Running) -> AsyncIterator[qflow.client.Connection]:
    c = await running.connect()
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture
async def ssn(conn: qflow.client.Connection) -> qflow.client.Session:
    return await conn.session()


@dataclass
class Daemon:
    proc: subprocess.Popen
    port: int
    mgmt_port: int
    log_path: str  # the daemon's stderr: a file, so no pipe can fill and block it

    def log(self) -> str:
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
        self.proc.stdout.close()
        os.unlink(self.log_path)


def start_qflowd(*args: str) -> Daemon:
    """Start ``qflowd`` as a subprocess on free ports and wait for its ready line."""
    fd, log_path = tempfile.mkstemp(prefix="qflowd-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ},
        )
    line = proc.stdout.readline()
    if not line.startswith("qflowd ready"):
        proc.kill()
        proc.wait()
        with open(log_path) as f:
            raise RuntimeError(f"qflowd did not start: {line!r} {f.read()}")
    fields = dict(item.split("=") for item in line.split()[2:])
    return Daemon(proc, int(fields["port"]), int(fields["mgmt-port"]), log_path)


@pytest.fixture
def qflowd() -> Iterator[Daemon]:
    d = start_qflowd()
    try:
        yield d
    finally:
        d.stop()
