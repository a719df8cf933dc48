"""Harnesses for tests, benchmarks and examples.

* :class:`Harness`: a broker served in memory, through the same protocol core
  and ConnectionPump that qflowd runs, with no sockets, no trio and no clock.
  Its clients are synchronous and frame-level: every byte moves when
  :meth:`Harness.run` says so, so what happens is deterministic.
* :func:`start`: a real ``qflowd`` as a child process, on free loopback ports;
  it returns once its ready line (``qflowd ready port=P mgmt-port=M``) has been
  read. ``Daemon.stop()`` stops that process, by its PID, and nothing else.
  Each gets a fresh temporary data directory of its own (removed by ``stop()``)
  unless ``--data-dir`` or ``--no-data-dir`` is given: tests and benchmarks never
  touch ``~/.qflowd``, and suites running side by side never share one.
"""

from __future__ import annotations

import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

from qflow import protocol as P
from qflow.broker import Broker
from qflow.broker.accounting import Accounting
from qflow.broker.settings import FlowDefaults
from qflow.protocol.connection import Completed, Failed, FlowNotice, ProtocolConnection, Result, Role
from qflow.protocol.entries import entry_tail, scan_entries, seq_and_size
from qflow.protocol.framing import DEFAULT_MAX_FRAME_SIZE
from qflow.protocol.parts import PartJoiner
from qflow.protocol.ranges import RangeSet
from qflow.server.pump import ConnectionPump


@dataclass
class Daemon:
    proc: subprocess.Popen
    port: int
    mgmt_port: int
    log_path: str | None = None  # where its stderr goes, if a file
    own_data_dir: str | None = None  # the temporary data directory start() made for it, removed by stop()
    ssl_port: int | None = None  # the TLS messaging port, when started with --ssl-cert-file

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        if self.log_path is None:
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def kill(self) -> None:
        """SIGKILL, as a crash or a power cut would end it: nothing is flushed or
        closed. Its temporary data directory stays until :meth:`stop`."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within 10 s; then its
        temporary data directory, if start() made one, is removed."""
        try:
            self._stop()
        finally:
            if self.own_data_dir is not None:
                shutil.rmtree(self.own_data_dir, ignore_errors=True)
                self.own_data_dir = None

    def _stop(self) -> None:
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
          timeout: float = 30, address_space: int | None = None) -> Daemon:
    """Start qflowd with ``args`` on a free protocol port (and, unless ``args``
    say otherwise, a free management port) and a fresh temporary data
    directory (unless ``args`` give ``--data-dir`` or ``--no-data-dir``). Its
    stderr goes to the file ``log``, or nowhere: a pipe nobody reads would fill
    and block it. ``address_space``: its address-space limit (RLIMIT_AS), bytes."""
    own_data_dir = None
    if not any(a in ("--data-dir", "--no-data-dir") or a.startswith("--data-dir=") for a in args):
        own_data_dir = tempfile.mkdtemp(prefix="qflowd-data-")
        args = ("--data-dir", own_data_dir, *args)
    try:
        return _start(args, env, log, timeout, own_data_dir, address_space)
    except BaseException:
        if own_data_dir is not None:
            shutil.rmtree(own_data_dir, ignore_errors=True)
        raise


def _start(args: tuple[str, ...], env: dict[str, str] | None, log: str | None, timeout: float,
           own_data_dir: str | None, address_space: int | None = None) -> Daemon:
    stderr: IO | int = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qflow.cli.qflowd", "--host", "127.0.0.1", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=stderr, text=True, env={**os.environ, **(env or {})},
            preexec_fn=None if address_space is None else partial(_limit_address_space, address_space),
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
    ssl_port = int(fields["ssl-port"]) if "ssl-port" in fields else None
    return Daemon(proc, int(fields["port"]), int(fields["mgmt-port"]), log, own_data_dir, ssl_port)


# Debian's chromium (the Makefile installs it); Playwright's own browser download is never used.
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync")


def chromium(playwright: Any, profile: str, *args: str, timeout: float = 90.0, **options: Any) -> Any:
    """A headless Chromium (Playwright's persistent context over the system
    browser, in the directory ``profile``), for the browser tests and
    tools/console_screenshot.py. ``args``: more command-line flags;
    ``options``: more of ``launch_persistent_context``'s (``http_credentials``,
    ``viewport``). ``timeout`` in seconds: room for a loaded machine."""
    return playwright.chromium.launch_persistent_context(
        profile, executable_path=CHROMIUM, headless=True, args=[*CHROMIUM_ARGS, *args], timeout=timeout * 1000,
        **options)


def _limit_address_space(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


# -- the in-memory harness -----------------------------------------------------------------------------
@dataclass
class Delivery:
    """A message as a harness session received it."""

    destination: str
    delivery_id: int
    sequence: int
    redelivered: bool
    exchange: str
    routing_key: str
    properties: dict | None
    body: bytes


@dataclass
class MemorySession:
    """A session of a :class:`MemoryClient`: it numbers its commands as the
    protocol does (0, 1, 2, ...) and keeps what the broker said of them."""

    client: MemoryClient
    channel: int = -1
    next_id: int = 0
    completed: RangeSet = field(default_factory=RangeSet)
    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, tuple[int, str]] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)
    held_by: set[str] = field(default_factory=set)  # queues whose flow control holds our transfers

    def command(self, code: int, *fields: Any) -> int:
        """Write command ``code`` with ``fields``; returns its command id."""
        cid = self.next_id
        self.next_id += 1
        self.client.protocol.encoder.write([code, self.channel, *fields])
        return cid

    def transfer(self, routing_key: str, body: bytes, exchange: str = "", properties: dict | None = None) -> int:
        return self.command(P.TRANSFER, exchange, routing_key, properties, body)

    def is_complete(self, command_id: int) -> bool:
        return command_id in self.completed

    def incomplete(self, command_ids: list[int]) -> list[int]:
        return [cid for cid in command_ids if cid not in self.completed]

    def call(self, code: int, *fields: Any) -> Any:
        """Run one command to its end (:meth:`Harness.run`) and return its
        result; raises AssertionError with the broker's code and text if it failed."""
        cid = self.command(code, *fields)
        self.client.harness.run()
        if cid in self.failures:
            code_, text = self.failures[cid]
            raise AssertionError(f"command {cid} failed: {code_} {text}")
        assert cid in self.completed, f"command {cid} did not complete"
        return self.results.get(cid)

    def declare_queue(self, name: str, arguments: dict | None = None) -> dict:
        return self.call(P.QUEUE_DECLARE, name, False, False, False, arguments or {}, False)

    def subscribe(self, queue: str, destination: str, credit: int = -1, accept: int = P.ACCEPT_NONE) -> None:
        self.call(P.SUBSCRIBE, queue, destination, accept, P.ACQUIRE_PRE_ACQUIRED, 0)
        self.call(P.FLOW, destination, credit, -1)

    def accept(self, deliveries: list[Delivery]) -> None:
        ids = RangeSet()
        for d in deliveries:
            ids.add(d.delivery_id)
        self.call(P.ACCEPT, ids.to_wire())

    def query(self, queue: str) -> dict:
        return self.call(P.QUEUE_QUERY, queue)


class MemoryClient:
    """One client connection of a :class:`Harness`: the client role of the
    protocol state machine on one side, a ConnectionPump on the broker's."""

    def __init__(self, harness: Harness, name: str, max_frame_size: int) -> None:
        self.harness = harness
        self.protocol = ProtocolConnection(Role.CLIENT, name=name, max_frame_size=max_frame_size)
        self.pump = ConnectionPump(harness.broker, max_frame_size, 0.0)
        self.flow_notices: list[tuple[int, str, bool]] = []  # (channel, queue, held), as received
        self._parts = PartJoiner()  # message.deliver-part frames joined
        self.reading = True  # False: a peer that reads nothing, so the broker's output to it stays queued

    def session(self, name: str = "") -> MemorySession:
        ssn = MemorySession(self)
        ssn.channel = self.protocol.attach(name, ssn)
        self.harness.run()
        return ssn

    def _to_broker(self) -> bool:
        if self.pump.unfinished is not None:  # one step of a long command per round, as qflowd does
            self.pump.step()
            return True
        data = self.protocol.encoder.take() if self.protocol.encoder.parts else b""
        if data:
            self.pump.receive(data, 0.0)
        return bool(data)

    def _from_broker(self) -> bool:
        data = self.pump.encoder.take() if self.pump.encoder.parts and self.reading else b""
        if not data:
            return False
        if self.pump.broker.stalled:  # as the server's writer does once a write is done
            self.pump.broker.output_drained()
        protocol = self.protocol
        protocol.receive_data(data, 0.0)
        for frame in protocol.decoder.frames():
            if frame[0] == P.DELIVER_PART:
                frame = self._parts.add(frame)
                if frame is None:
                    continue
            if frame[0] == P.DELIVER_RUN:
                self._deliveries(frame)
                continue
            event = protocol.receive_control(frame)
            kind = type(event)
            if kind is Completed:
                event.session.completed.update(RangeSet.from_wire(event.ranges))
            elif kind is Result:
                event.session.results[event.command_id] = event.value
            elif kind is Failed:
                event.session.failures[event.command_id] = (event.code, event.text)
            elif kind is FlowNotice:
                (event.session.held_by.add if event.held else event.session.held_by.discard)(event.queue)
                self.flow_notices.append((event.session.channel, event.queue, event.held))
        return True

    def _deliveries(self, frame: list[Any]) -> None:
        _, channel, destination, first_id, count, blob = frame
        ssn = self.protocol.sessions[channel]
        offsets = scan_entries(blob, count)
        for i in range(count):
            entry = blob[offsets[2 * i]:offsets[2 * i + 2]]
            exchange, key, props, body = entry_tail(entry)
            ssn.deliveries.append(Delivery(destination, first_id + i, seq_and_size(entry)[0],
                                           entry[0] == 0xC3, exchange, key, props, body))


class Harness:
    """A broker served in memory, deterministically: nothing moves between a
    client and the broker until :meth:`run`, which moves bytes both ways,
    one read at a time per connection, until nothing is left to move."""

    def __init__(self, defaults: FlowDefaults | None = None, accounting: Accounting | None = None,
                 transfer_runs: bool | None = None) -> None:
        self.broker = Broker(defaults, accounting, transfer_runs)
        self.clients: list[MemoryClient] = []

    def connect(self, name: str = "", max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> MemoryClient:
        client = MemoryClient(self, name, max_frame_size)
        self.clients.append(client)
        self.run()
        return client

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for client in self.clients:
                moved |= client._to_broker()
            for client in self.clients:
                moved |= client._from_broker()
