"""Latency under a steady load: one producer at a fixed rate, one consumer
that stamps each arrival, qflowd in its own process (``make bench`` runs it;
``python bench/latency.py`` runs it alone, ``--trace`` adds the per-hop
breakdown of bench/README.md's "Latency").

A message's latency is the time from the producer's ``Sender.send`` call to
the consumer's ``Receiver.fetch`` returning it. Both read CLOCK_MONOTONIC
(``time.monotonic_ns``), which Linux keeps system-wide, so the stamps of two
processes compare. The producer writes the stamps into the message's 64-byte
body (its sequence number, its *intended* send time and its actual send
call), so that every message stays a plain one of the sender's fast path.

The producer keeps to a timeline fixed in advance: message i is due at
``t0 + i / rate``. Each time it wakes it sends every message already due, one
``send`` call each, then sleeps (``trio.sleep``) until the next one is due.
A trio sleep lasts at least about a millisecond (epoll's resolution), so at
10,000 msg/s it sends about ten per wake-up. A producer late for any reason
(a long sleep, its window full) sends what it owes at once, and each
message's latency is also measured from its intended time: a latency that
counted only from the actual send call would leave out the time the message
waited to be sent (coordinated omission). Both are reported; ``intended``
minus ``send call`` is the producer's own lag.
"""

from __future__ import annotations

import argparse
import array
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time

import trio

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(1, os.path.dirname(HERE))

from processes import NO_FLOW, cpu_seconds, start_broker  # noqa: E402
from processes import declare as _declare  # noqa: E402
from processes import expect as _expect  # noqa: E402
from processes import ready as _ready  # noqa: E402

import qflow  # noqa: E402

RATES = (1_000, 10_000, 50_000)
SIZE = 64
CAPACITY = 1000  # the sender's window and the receiver's credit, as make bench's throughput runs
# The body: a tag, the sequence number, the intended and the actual send time (ns, CLOCK_MONOTONIC), padding.
# A traced message's tag is TRACE_TAG: the tracing shim (bench/latency_trace) finds it in the bytes each
# process writes and reads, and the sequence number after it says which message it was.
BODY = struct.Struct("<8sqqq")
TRACE_TAG = b"\xffQFLTRC\xff"
PLAIN_TAG = b"........"
PAD = b"." * (SIZE - BODY.size)
QUEUE = "latency"
TRACE_SITE = os.path.join(HERE, "latency_trace")  # its sitecustomize installs the shim when QFLOW_LATENCY_TRACE is set


# -- the client processes ------------------------------------------------------
async def _produce(port: int, rate: float, count: int, durable: bool, trace_every: int) -> None:
    async with await qflow.connect("127.0.0.1", port) as conn:
        ssn = await conn.session()
        sender = ssn.sender(QUEUE, capacity=CAPACITY, durable=durable)
        send = sender.send
        pack = BODY.pack
        clock = time.monotonic_ns
        interval = 1e9 / rate
        _ready()
        t0 = clock()
        i = 0
        wakeups = 0
        while i < count:
            now = clock()
            due = min(count, int((now - t0) / interval) + 1)  # every message whose time has come
            wakeups += 1
            while i < due:
                tag = TRACE_TAG if trace_every and i % trace_every == 0 else PLAIN_TAG
                sent = clock()
                await send(pack(tag, i, t0 + int(i * interval), sent) + PAD)
                i += 1
            if i < count:
                ahead = t0 + i * interval - clock()
                if ahead > 0:
                    await trio.sleep(ahead / 1e9)
        t_end = clock()
        await sender.sync()
        print("RESULT " + json.dumps({"wakeups": wakeups, "send_s": (t_end - t0) / 1e9}), flush=True)


def _percentiles(values: array.array) -> dict:
    """p50, p99, p99.9 and max of ``values`` (ns), in ms (nearest rank)."""
    s = sorted(values)
    n = len(s)

    def rank(q: float) -> float:
        return round(s[max(0, math.ceil(q * n) - 1)] / 1e6, 3)

    return {"p50": rank(0.5), "p99": rank(0.99), "p999": rank(0.999), "max": round(s[-1] / 1e6, 3), "n": n}


async def _consume(port: int, count: int, warm: int, trace_out: str) -> None:
    async with await qflow.connect("127.0.0.1", port) as conn:
        ssn = await conn.session()
        receiver = await ssn.receiver(QUEUE, capacity=CAPACITY, accept="auto")
        fetch = receiver.fetch
        unpack = BODY.unpack_from
        clock = time.monotonic_ns
        from_send = array.array("q", bytes(8 * (count - warm)))
        from_intended = array.array("q", bytes(8 * (count - warm)))
        traced = []
        _ready()
        for k in range(count):
            message = await fetch(timeout=60)
            t = clock()  # the fetch has returned
            tag, seq, intended, sent = unpack(message.body)
            if seq != k:
                raise SystemExit(f"latency consumer: message {seq} arrived as number {k}")
            if k >= warm:
                from_send[k - warm] = t - sent
                from_intended[k - warm] = t - intended
                if tag == TRACE_TAG:
                    traced.append((seq, intended, sent, t))
        await receiver.close()
        await ssn.sync()
        if trace_out:
            with open(trace_out, "w") as f:
                json.dump(traced, f)
        print("RESULT " + json.dumps({"from_send": _percentiles(from_send),
                                      "from_intended": _percentiles(from_intended)}), flush=True)


def client_main(argv: list[str]) -> None:
    role, port, rate, count = argv[0], int(argv[1]), float(argv[2]), int(argv[3])
    if role == "produce":
        trio.run(_produce, port, rate, count, argv[4] == "durable", int(argv[5]))
    else:
        trio.run(_consume, port, count, int(argv[4]), argv[5])


# -- one point ------------------------------------------------------------------
def run_queue_wait_s(pid: int) -> float:
    """Seconds process ``pid``'s main thread has spent runnable but waiting for a CPU (/proc schedstat)."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _client(args: list[str], env: dict | None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--client", *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _trace_env(trace_dir: str, role: str) -> dict:
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": TRACE_SITE + (os.pathsep + path if path else ""),
            "QFLOW_LATENCY_TRACE": os.path.join(trace_dir, role + ".json")}


def point(rate: int, duration: float, warmup: float, durable: bool, trace_every: int = 0,
          trace_dir: str = "") -> dict:
    """One latency point: a fresh qflowd (with a temporary --data-dir, as every
    bench qflowd has), a queue (durable if ``durable``, as the producer's
    sender then is), ``warmup`` seconds at ``rate`` that are not counted, then
    ``duration`` seconds that are. ``trace_every``: every so many messages
    carry the trace tag, and the three processes run with the tracing shim,
    which writes its stamps into ``trace_dir``."""
    warm = int(rate * warmup)
    count = warm + max(1, int(rate * duration))
    tracing = bool(trace_every)
    d = start_broker(env=_trace_env(trace_dir, "broker") if tracing else None)
    try:
        trio.run(_declare, d.port, QUEUE, NO_FLOW, None, durable)
        consumer = _client(["consume", d.port, rate, count, warm,
                            os.path.join(trace_dir, "consumer_fetch.json") if tracing else ""],
                           _trace_env(trace_dir, "consumer") if tracing else None)
        producer = _client(["produce", d.port, rate, count, "durable" if durable else "transient", trace_every],
                           _trace_env(trace_dir, "producer") if tracing else None)
        procs = (consumer, producer)
        try:
            for proc in procs:
                _expect(proc, "READY")
            broker_cpu = cpu_seconds(d.proc.pid)
            pids = {"broker": d.proc.pid, "consumer": consumer.pid, "producer": producer.pid}
            waits = {name: run_queue_wait_s(pid) for name, pid in pids.items()}
            t_go = time.monotonic()
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            got, sent = (json.loads(_expect(proc, "RESULT")) for proc in procs)
            broker_cpu = cpu_seconds(d.proc.pid) - broker_cpu
            elapsed = time.monotonic() - t_go
            # The share of the run each process spent ready to run but waiting for a CPU: the load's part.
            waits = {name: round(100 * (run_queue_wait_s(pid) - waits[name]) / elapsed, 1)
                     for name, pid in pids.items()}
            for proc in procs:
                proc.stdin.close()
                if proc.wait():
                    raise SystemExit("a latency client failed")
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    finally:
        d.stop()  # SIGTERM: a traced qflowd writes its stamps as it exits
    return {"rate": rate, "persistent": durable, "seconds": duration, "warmup_s": warmup, **got,
            "achieved_rate": round(count / sent["send_s"]) if sent["send_s"] else None,
            "sends_per_wakeup": round(count / sent["wakeups"], 1),
            "broker_cpu_pct": round(100 * broker_cpu / elapsed, 1), "run_queue_wait_pct": waits}


def measure(duration: float, warmup: float, rates: tuple[int, ...] = RATES) -> list[dict]:
    """Every rate, transient then persistent, one fresh qflowd per point."""
    return [point(rate, duration, warmup, durable) for rate in rates for durable in (False, True)]


def table(points: list[dict]) -> str:
    """The figures as make bench prints them: ms from the send call, and from the intended send time."""
    lines = [f"{'latency, ms':>22}: {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>8}   "
             f"{'from the intended send time: p50':>32} {'p99':>7} {'p99.9':>7} {'max':>8}   sent/wake  broker CPU"
             "   waiting for a CPU: broker/producer/consumer"]
    for p in points:
        a, b = p["from_send"], p["from_intended"]
        name = f"{p['rate'] // 1000}k msg/s {'persistent' if p['persistent'] else 'transient'}"
        lines.append(f"{name:>22}: {a['p50']:>7.3f} {a['p99']:>7.3f} {a['p999']:>7.3f} {a['max']:>8.3f}   "
                     f"{b['p50']:>32.3f} {b['p99']:>7.3f} {b['p999']:>7.3f} {b['max']:>8.3f}   "
                     f"{p['sends_per_wakeup']:>9} {p['broker_cpu_pct']:>9}%   "
                     + "/".join(f"{p['run_queue_wait_pct'][k]}%" for k in ("broker", "producer", "consumer")))
    return "\n".join(lines)


def json_keys(points: list[dict]) -> dict:
    """The JSON line's latency keys: latency_p50_ms_10k, ..., latency_p99_ms_10k_persistent, ... (from the
    send call), the same with _intended (from the intended send time), and the producer's achieved rates."""
    out: dict = {}
    for p in points:
        rate = f"{p['rate'] // 1000}k"
        suffix = "_persistent" if p["persistent"] else ""
        for origin, tail in (("from_send", ""), ("from_intended", "_intended")):
            for q in ("p50", "p99", "p999", "max"):
                out[f"latency_{q}_ms_{rate}{suffix}{tail}"] = p[origin][q]
        out[f"latency_achieved_rate_{rate}{suffix}"] = p["achieved_rate"]
    return out


# -- the breakdown --------------------------------------------------------------
HOPS = ("client write", "to the broker's read", "broker read to dispatch", "dispatch to the consumer's read",
        "consumer's read to fetch")


def breakdown(trace_dir: str) -> dict:
    """Each traced message's time split at the stamps the shim took: the
    producer's send call (in the body), its write of the bytes holding the
    message (as ``send_all`` began), qflowd's read of them, qflowd's write of
    the delivery (as it began), the consumer's read of it, and its fetch returning.
    Per hop: p50 and p99 over the traced messages, and the mean over the
    messages at or above the end-to-end p99 (where the tail's time goes)."""
    def stamps(role: str, direction: str) -> dict[int, int]:
        with open(os.path.join(trace_dir, role + ".json")) as f:
            return {seq: t for seq, t in json.load(f)[direction]}

    written = stamps("producer", "sent")
    broker_read, broker_wrote = stamps("broker", "received"), stamps("broker", "sent")
    consumer_read = stamps("consumer", "received")
    with open(os.path.join(trace_dir, "consumer_fetch.json")) as f:
        fetched = json.load(f)
    rows = []
    for seq, _intended, sent, t in fetched:
        hops = (written.get(seq), broker_read.get(seq), broker_wrote.get(seq), consumer_read.get(seq))
        if None in hops:  # the tag fell across two reads: not found whole in either
            continue
        times = (sent, *hops, t)
        rows.append((t - sent, [b - a for a, b in zip(times, times[1:], strict=False)]))
    if not rows:
        raise SystemExit("latency trace: no traced message was seen at every hop")
    rows.sort()
    n = len(rows)
    tail = rows[max(0, math.ceil(0.99 * n) - 1):]

    def q(values: list[int], quantile: float) -> float:
        s = sorted(values)
        return round(s[max(0, math.ceil(quantile * len(s)) - 1)] / 1e6, 3)

    out = {"traced": n, "end_to_end_p50_ms": q([r[0] for r in rows], 0.5),
           "end_to_end_p99_ms": q([r[0] for r in rows], 0.99), "tail_messages": len(tail), "hops": {}}
    for h, name in enumerate(HOPS):
        values = [r[1][h] for r in rows]
        out["hops"][name] = {"p50_ms": q(values, 0.5), "p99_ms": q(values, 0.99),
                             "tail_mean_ms": round(sum(r[1][h] for r in tail) / len(tail) / 1e6, 3)}
    return out


def traced_point(rate: int, duration: float, warmup: float, durable: bool, every: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="qflow-latency-trace-") as trace_dir:
        result = point(rate, duration, warmup, durable, trace_every=every, trace_dir=trace_dir)
        return {"point": result, "breakdown": breakdown(trace_dir)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default=",".join(map(str, RATES)), help="msg/s, comma-separated")
    parser.add_argument("--duration", type=float, default=30, help="counted seconds per point")
    parser.add_argument("--warmup", type=float, default=2, help="seconds at the rate before counting")
    parser.add_argument("--persistent", choices=("both", "no", "yes"), default="both")
    parser.add_argument("--trace", type=int, default=0, metavar="N",
                        help="tag every Nth message and stamp it at each hop (the shim in bench/latency_trace); "
                             "prints the breakdown per point")
    args = parser.parse_args()
    rates = tuple(int(r) for r in args.rates.split(","))
    kinds = {"both": (False, True), "no": (False,), "yes": (True,)}[args.persistent]
    if args.trace:
        for rate in rates:
            for durable in kinds:
                print(json.dumps(traced_point(rate, args.duration, args.warmup, durable, args.trace)), flush=True)
        return
    points = [point(rate, args.duration, args.warmup, durable) for rate in rates for durable in kinds]
    print(table(points))
    print(json.dumps({"points": points, **json_keys(points)}))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2:])
    else:
        main()
