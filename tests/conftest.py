"""Shared fixtures: a broker served in-process on a free loopback port, and a
real ``qflowd`` subprocess for the tests that need one."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import trio

import qflow
from qflow.broker import Broker
from qflow.broker.settings import FlowDefaults
from qflow.server import Server
from qflow.testing import Daemon
from qflow.testing import start as start_daemon


def examples(n: int) -> int:
    """A Hypothesis test's example count: ``n`` in ``make test``, ``n`` times
    ``QFLOW_FUZZ_SCALE`` under ``make fuzz`` (tools/fuzz.py), which looks far
    harder for a rare disagreement than CI's one draw can."""
    return n * max(1, int(os.environ.get("QFLOW_FUZZ_SCALE") or 1))


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
    """A client connection to ``running``, its tasks in this fixture's nursery (open_connection)."""
    async with qflow.open_connection(running.host, running.port) as c:
        yield c


@pytest.fixture
async def ssn(conn: qflow.client.Connection) -> qflow.client.Session:
    return await conn.session()


def start_qflowd(*args: str) -> Daemon:
    """Start ``qflowd`` as a subprocess on free ports; its log goes to a temp file."""
    fd, log_path = tempfile.mkstemp(prefix="qflowd-", suffix=".log")
    os.close(fd)
    return start_daemon(*args, log=log_path)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    """One qflowd on free ports, shared by a module's tests (a module may define its own)."""
    d = start_qflowd("--mgmt-port", "0")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def qflowd() -> Iterator[Daemon]:
    d = start_qflowd()
    try:
        yield d
    finally:
        d.stop()


async def wait_for(predicate, timeout: float = 30) -> None:
    """Poll ``predicate`` (sync or async) until it is true; fails after ``timeout``
    seconds, which is room for a slow machine, never a timing assertion."""
    with trio.fail_after(timeout):
        while True:
            result = predicate()
            if hasattr(result, "__await__"):
                result = await result
            if result:
                return
            await trio.sleep(0.01)


def table_after(text: str, title: str) -> dict[str, str]:
    """The one-row qflow-stat table under the line that starts with ``title``, by its header's names."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(title))
    head, _rule, row = lines[at + 1:at + 4]
    return table_columns(head, row)


def bytes_of(text: str) -> float:
    """A qflow-stat size (512B, 1.5K, 9.4G) as bytes, to the precision it is shown with."""
    units = {"B": 1, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3, "T": 1024 ** 4}
    return float(text[:-1]) * units[text[-1]]


def table_columns(head: str, row: str) -> dict[str, str]:
    """A qflow-stat table row by its header's names. Numbers and flags are
    right-aligned under their names (a flag that is off is blank), so each
    value is what lies between the end of the name before and the end of its own."""
    out, before = {}, 0
    for m in re.finditer(r"\S+", head):
        out[m.group()] = row[before:m.end()].strip()
        before = m.end()
    return out


def stats_but_incarnation(q) -> dict:
    """A queue's statistics without its incarnation, a random id made with the
    queue: for comparing two brokers fed the same input."""
    return {k: v for k, v in q.stats().items() if k != "incarnation"}
