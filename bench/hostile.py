"""Attacks on qflowd as a hostile client would make them: ``python bench/hostile.py ATTACK``.

Each starts a fresh qflowd on loopback (or uses ``--broker HOST:PORT`` with
``--pid`` to measure a running one), runs one attack, and ends with one JSON
line of what it measured: qflowd's resident set (from /proc/PID/status) before,
during and after, and for the attacks on latency a probe's worst round trip (a
second client doing a ``queue.query`` round trip every 50 ms). The tests in
tests/test_hostile.py run the same attacks, smaller, against their bounds.

    python bench/hostile.py nested-claims [--connections 10] [--depth 1000] [--claim 65535]

* ``disk-full``: qflowd's data directory on a 2 MiB tmpfs (mounted by this
  script: run it under ``unshare -m``, or ``unshare -rm`` when not root, so
  that the mount is its own and goes with it); a durable producer fills it
  until qflowd stops on ENOSPC; then qflowd is started again on the
  still-full disk, and a consumer drains the queue.
* ``flipped-byte``: 10 batches of 500 persistent messages (each synced) to
  a durable queue; qflowd stopped; byte 44 of ``journal/00000001.jrn``
  XORed; qflowd started again; how many messages came back, and the log's
  lines about the journal.
* ``auth-flood``: qflowd with ``--auth yes``; ``--threads`` clients guess
  passwords for ``--duration`` seconds (PLAIN with a wrong password, or with
  ``--scram`` SCRAM-SHA-256 with a garbage proof), each attempt a new
  connection, while a probe (authenticated before the flood) does its round
  trips: attempts per second, qflowd's log lines about them, the probe's
  worst round trip.
* ``alarm-flood``: qflowd with ``--memory-high-watermark`` (``--high``, MB),
  a producer with capacity 1,000,000 sending ``--count`` messages of 4 KiB
  to a queue that never stops (``qpid.max_size`` 0), alone for 5 s, then with
  a consumer draining: qflowd's peak resident set (sampled every 50 ms), and
  whether every message sent was completed and drained.
* ``nested-claims``: after attaching a session, each connection sends an
  unfinished transfer whose properties are ``--depth`` nested ``array16(65535)``
  heads (3 bytes each) and keeps its socket open; then they all close.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import threading
import time
from pathlib import Path

import msgpack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qflow import protocol as P  # noqa: E402
from qflow.protocol.framing import PROTOCOL_HEADER  # noqa: E402

TIMEOUT = 60


def rss_kib(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1))


def settled_rss(pid: int, quiet: float = 1.0, timeout: float = 60.0) -> int:
    """The resident set (KiB) once it has not changed for ``quiet`` seconds."""
    last, since = rss_kib(pid), time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = rss_kib(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            break
    return last


def raw_session(port: int, name: str = "hostile", plain: tuple[str, str] | None = None) -> socket.socket:
    """A raw connection: header, open (ANONYMOUS, or PLAIN with ``plain``'s user
    and password), attach on channel 0 (the replies are left unread)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    opts: dict = {"name": name}
    if plain is not None:
        opts.update(mechanism="PLAIN", response=b"\0" + plain[0].encode() + b"\0" + plain[1].encode())
    s.sendall(PROTOCOL_HEADER + msgpack.packb([P.OPEN, opts]) + msgpack.packb([P.ATTACH, 0, name]))
    return s


def read_frames(s: socket.socket, until: float = TIMEOUT) -> list:
    """Every frame the broker sends until it closes the socket (or ``until`` seconds pass)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    s.settimeout(until)
    try:
        while data := s.recv(65536):
            unpacker.feed(data)
    except (TimeoutError, ConnectionResetError):
        pass
    return list(unpacker)


def nested_claims(depth: int = 1000, claim: int = 65535) -> bytes:
    """An unfinished transfer on channel 0 whose properties are ``depth`` nested
    array16(claim) heads: 3 bytes claiming ``claim`` elements each."""
    return b"\x96\x1e\x00\xa0\xa1q" + (b"\xdc" + claim.to_bytes(2, "big")) * depth


class Probe:
    """A second client doing a round trip (queue.query) every 50 ms; ``worst`` is its slowest, in seconds."""

    def __init__(self, port: int, plain: tuple[str, str] | None = None) -> None:
        self.s = raw_session(port, "probe", plain)
        self.unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        self.s.sendall(msgpack.packb([P.QUEUE_DECLARE, 0, "probe", False, False, False, {}, False]))
        self.commands = 1
        self._wait_result(0)
        self.worst = 0.0
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _wait_result(self, cid: int) -> None:
        while True:
            for frame in self.unpacker:
                if frame[0] == P.RESULT and frame[2] == cid:
                    return
                if frame[0] == P.CLOSE:
                    raise RuntimeError(f"probe closed: {frame}")
            data = self.s.recv(65536)
            if not data:
                raise RuntimeError("probe: connection closed")
            self.unpacker.feed(data)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            self.s.sendall(msgpack.packb([P.QUEUE_QUERY, 0, "probe"]))
            self._wait_result(self.commands)
            self.commands += 1
            self.worst = max(self.worst, time.perf_counter() - t)
            self.rounds += 1
            self._stop.wait(0.05)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(TIMEOUT)
        self.s.close()


def attack_nested_claims(port: int, pid: int, connections: int, depth: int, claim: int = 65535) -> dict:
    base = settled_rss(pid)
    socks = []
    closed = []
    for i in range(connections):
        s = raw_session(port, f"nested-{i}")
        s.sendall(nested_claims(depth, claim))
        socks.append(s)
    held = settled_rss(pid)
    for s in socks:
        s.settimeout(2)
        frames = read_frames(s, 2)
        closed.append(next((f for f in frames if f[0] == P.CLOSE), None))
        s.close()
    after = settled_rss(pid)
    return {"attack": "nested-claims", "connections": connections, "depth": depth, "claim": claim,
            "input_bytes_each": len(nested_claims(depth, claim)), "rss_base_kib": base, "rss_held_kib": held,
            "rss_after_close_kib": after, "grown_per_connection_kib": round((held - base) / connections),
            "closes": [c for c in closed if c][:1], "closed_by_broker": sum(1 for c in closed if c)}


def attack_disk_full(size: str = "2m") -> dict:
    """See the module's doc: ``disk-full``. Needs to be able to mount a tmpfs."""
    import subprocess
    import tempfile

    import trio

    import qflow
    from qflow.testing import start

    where = tempfile.mkdtemp(prefix="qflow-diskfull-")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], check=True)
    data = os.path.join(where, "data")
    out: dict = {"attack": "disk-full", "tmpfs": size}

    async def produce(port: int) -> int:
        sent = 0
        try:
            async with qflow.open_connection("127.0.0.1", port) as conn:
                ssn = await conn.session()
                await ssn.declare_queue("q", durable=True)
                sender = ssn.sender("q", capacity=100, durable=True)
                with trio.move_on_after(TIMEOUT):
                    while True:
                        await sender.send(b"x" * 3000)
                        sent += 1
        except (qflow.ConnectionClosed, BaseExceptionGroup):  # the broker stopped: the disk is full
            pass
        return sent

    async def consume(port: int) -> int:
        got = 0
        async with qflow.open_connection("127.0.0.1", port) as conn:
            ssn = await conn.session()
            receiver = await ssn.receiver("q")
            while True:
                try:
                    got += len(await receiver.fetch_many(100, timeout=3))
                except qflow.Empty:
                    return got

    logs = [os.path.join(tempfile.gettempdir(), f"qflow-diskfull-{os.getpid()}-{i}.log") for i in range(2)]
    try:
        d = start("--data-dir", data, log=logs[0])
        out["sent"] = trio.run(produce, d.port)
        try:
            out["first_exit"] = d.proc.wait(timeout=TIMEOUT)
        finally:
            d.stop()
        stat = os.statvfs(where)
        out["free_bytes_before_restart"] = stat.f_bavail * stat.f_frsize
        try:
            d = start("--data-dir", data, log=logs[1], timeout=TIMEOUT)
        except Exception as exc:
            out["restarted"] = False
            out["restart_error"] = str(exc).splitlines()[-1][:300]
        else:
            out["restarted"] = True
            try:
                out["recovered"] = trio.run(consume, d.port)
                time.sleep(1)
                out["alive_after_drain"] = d.proc.poll() is None
                stat = os.statvfs(where)
                out["free_bytes_after_drain"] = stat.f_bavail * stat.f_frsize
            finally:
                d.stop()
            out["restart_log"] = [line[24:] for line in Path(logs[1]).read_text().splitlines()
                                  if "ERROR" in line or "WARNING" in line]
    finally:
        subprocess.run(["umount", "-l", where], check=False)
        os.rmdir(where)
        for log in logs:
            if os.path.exists(log):
                os.unlink(log)
    return out


def attack_flipped_byte(batches: int = 10, per_batch: int = 500, offset: int = 44) -> dict:
    """See the module's doc: ``flipped-byte``."""
    import shutil
    import tempfile

    import trio

    import qflow
    from qflow.testing import start

    data = tempfile.mkdtemp(prefix="qflow-flip-")
    log = os.path.join(data, "qflowd.log")

    async def produce(port: int) -> None:
        async with qflow.open_connection("127.0.0.1", port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("q", durable=True)
            sender = ssn.sender("q", capacity=per_batch, durable=True)
            for b in range(batches):
                await sender.send_many(b"%d.%d" % (b, i) for i in range(per_batch))
                await sender.sync()

    async def depth(port: int) -> int:
        async with qflow.open_connection("127.0.0.1", port) as conn:
            ssn = await conn.session()
            return (await ssn.query_queue("q"))["msgDepth"]

    try:
        d = start("--data-dir", os.path.join(data, "d"))
        try:
            trio.run(produce, d.port)
        finally:
            d.stop()
        path = Path(data, "d", "journal", "00000001.jrn")
        raw = bytearray(path.read_bytes())
        raw[offset] ^= 0x40
        path.write_bytes(bytes(raw))
        d = start("--data-dir", os.path.join(data, "d"), log=log)
        try:
            recovered = trio.run(depth, d.port)
        finally:
            d.stop()
        lines = [line[24:] for line in Path(log).read_text().splitlines() if "journal" in line and
                 ("ERROR" in line or "WARNING" in line)]
    finally:
        shutil.rmtree(data, ignore_errors=True)
    return {"attack": "flipped-byte", "sent": batches * per_batch, "offset": offset, "recovered": recovered,
            "log": lines}


def _guess(port: int, scram: bool) -> None:
    """One failed attempt on a new connection: PLAIN with a wrong password, or SCRAM with a garbage proof."""
    import base64
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        if scram:
            s.sendall(PROTOCOL_HEADER + msgpack.packb([P.OPEN, {"mechanism": "SCRAM-SHA-256",
                                                                "response": b"n,,n=alice,r=abcdef"}]))
            unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
            while True:
                data = s.recv(65536)
                if not data:
                    return
                unpacker.feed(data)
                frames = list(unpacker)
                challenge = next((f for f in frames if f[0] == P.SASL_CHALLENGE), None)
                if challenge is not None:
                    nonce = challenge[1].decode().split(",")[0][2:]
                    proof = base64.b64encode(bytes(32)).decode()
                    s.sendall(msgpack.packb([P.SASL_RESPONSE, f"c=biws,r={nonce},p={proof}".encode()]))
                    break
                if any(f[0] == P.CLOSE for f in frames):
                    return
        else:
            s.sendall(PROTOCOL_HEADER + msgpack.packb([P.OPEN, {"mechanism": "PLAIN",
                                                                "response": b"\0alice\0wrong"}]))
        while s.recv(65536):
            pass


def attack_auth_flood(threads: int = 4, duration: float = 8.0, scram: bool = False) -> dict:
    """See the module's doc: ``auth-flood``."""
    import subprocess
    import tempfile

    from qflow.testing import start

    where = tempfile.mkdtemp(prefix="qflow-auth-")
    users = os.path.join(where, "users")
    subprocess.run([sys.executable, "-m", "qflow.cli.qflow_passwd", "--sasl-db", users, "alice"],
                   input="right\n", text=True, check=True, capture_output=True)
    log = os.path.join(where, "qflowd.log")
    d = start("--no-data-dir", "--auth", "yes", "--sasl-db", users, log=log)
    attempts = [0] * threads
    stop = threading.Event()

    def guesser(i: int) -> None:
        while not stop.is_set():
            try:
                _guess(d.port, scram)
            except OSError:
                pass
            attempts[i] += 1

    try:
        with Probe(d.port, ("alice", "right")) as probe:
            time.sleep(1)
            idle = probe.worst
            probe.worst = 0.0
            workers = [threading.Thread(target=guesser, args=(i,), daemon=True) for i in range(threads)]
            t0 = time.monotonic()
            for w in workers:
                w.start()
            time.sleep(duration)
            stop.set()
            elapsed = time.monotonic() - t0
            for w in workers:
                w.join(TIMEOUT)
            worst = probe.worst
    finally:
        d.stop()
    text = Path(log).read_text()
    lines = [line for line in text.splitlines() if "authentication failed" in line]
    import shutil
    shutil.rmtree(where, ignore_errors=True)
    return {"attack": "auth-flood", "mechanism": "SCRAM-SHA-256" if scram else "PLAIN", "threads": threads,
            "seconds": round(elapsed, 1), "attempts": sum(attempts),
            "attempts_per_s": round(sum(attempts) / elapsed, 1), "log_lines": len(lines),
            "probe_idle_worst_ms": round(idle * 1000, 1), "probe_worst_ms": round(worst * 1000, 1)}


def attack_alarm_flood(high_mb: int = 100, count: int = 100_000, size: int = 4096, seconds: float = 5.0) -> dict:
    """See the module's doc: ``alarm-flood``."""
    import trio

    import qflow
    from qflow.testing import start

    d = start("--no-data-dir", "--memory-high-watermark", str(high_mb * 1024 * 1024))
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], rss_kib(d.proc.pid))
            except (OSError, AttributeError):
                return
            time.sleep(0.05)

    async def produce(done: trio.Event) -> int:
        sent = 0
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            sender = ssn.sender("q", capacity=1_000_000)
            body = b"x" * size
            while sent < count:
                await sender.send(body)
                sent += 1
            await sender.sync()  # every one completed: taken and enqueued
        done.set()
        return sent

    async def drain(done: trio.Event) -> int:
        got = 0
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            receiver = await ssn.receiver("q")
            while True:
                try:
                    got += len(await receiver.fetch_many(1000, timeout=3))
                except qflow.Empty:
                    if done.is_set():
                        return got

    async def run() -> tuple[int, int]:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("q", arguments={"qpid.max_size": 0, "qpid.max_count": 0})
        done = trio.Event()
        out = {}
        with trio.fail_after(TIMEOUT * 3):
            async with trio.open_nursery() as nursery:
                async def producing() -> None:
                    out["sent"] = await produce(done)

                async def draining() -> None:
                    await trio.sleep(seconds)  # the flood first, alone
                    out["drained"] = await drain(done)
                nursery.start_soon(producing)
                nursery.start_soon(draining)
        return out["sent"], out["drained"]

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        base = rss_kib(d.proc.pid)
        sampler.start()
        sent, drained = trio.run(run)
    finally:
        stop.set()
        sampler.join(5)
        d.stop()
    return {"attack": "alarm-flood", "high_watermark_mb": high_mb, "message_size": size, "sent": sent,
            "drained": drained, "rss_base_mb": round(base / 1024), "rss_peak_mb": round(peak[0] / 1024),
            "peak_over_high_mb": round(peak[0] / 1024 - high_mb)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("attack", choices=["nested-claims", "disk-full", "flipped-byte", "auth-flood", "alarm-flood"])
    ap.add_argument("--high", type=int, default=100, help="alarm-flood: the high watermark, MB")
    ap.add_argument("--count", type=int, default=100_000, help="alarm-flood: messages to send")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--scram", action="store_true", help="auth-flood: SCRAM-SHA-256 garbage proofs, not PLAIN")
    ap.add_argument("--connections", type=int, default=10)
    ap.add_argument("--depth", type=int, default=1000)
    ap.add_argument("--claim", type=int, default=65535, help="elements each nested array16 head claims")
    ap.add_argument("--qflowd-arg", action="append", default=[], help="an extra qflowd argument (repeatable)")
    args = ap.parse_args()
    if args.attack == "disk-full":
        print(json.dumps(attack_disk_full()))
        return
    if args.attack == "alarm-flood":
        print(json.dumps(attack_alarm_flood(args.high, args.count)))
        return
    if args.attack == "auth-flood":
        print(json.dumps(attack_auth_flood(args.threads, args.duration, args.scram)))
        return
    if args.attack == "flipped-byte":
        print(json.dumps(attack_flipped_byte()))
        return
    from qflow.testing import start
    d = start("--no-data-dir", *args.qflowd_arg)
    try:
        if args.attack == "nested-claims":
            out = attack_nested_claims(d.port, d.proc.pid, args.connections, args.depth, args.claim)
    finally:
        d.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
