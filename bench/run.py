"""qflow benchmarks: ``make bench`` (full) and ``make bench-smoke`` (seconds).

Each workload runs qflowd, one producer and one consumer as three processes
over loopback, as a user would. Figures drift on these shared 2-core
machines, so every run also times a fixed pure-Python spin loop before and
after (``spin_loop_s``): compare runs by ratios, not absolute numbers.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import trio

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# The pieces every benchmark shares (bench/processes.py), under the names the other scripts import from here.
from processes import NO_FLOW, cpu_seconds, start_broker  # noqa: E402, F401
from processes import declare as _declare  # noqa: E402
from processes import expect as _expect  # noqa: E402
from processes import ready as _ready  # noqa: E402

import qflow  # noqa: E402
from qflow import testing as qflowd  # noqa: E402


# Queue arguments for the throughput runs: no limit and no flow control.
def spin_loop() -> float:
    """A fixed pure-Python workload: seconds it takes now on this machine."""
    t0 = time.perf_counter()
    x = 0
    for i in range(3_000_000):
        x += i & 7
    return time.perf_counter() - t0


def rss_peak_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# -- the client processes ------------------------------------------------------
# Two styles of client: "each" calls send / fetch once per message (what most
# code does), "batch" calls send_many / fetch_many (what a program moving many
# messages at once can do). Both keep the sender's capacity and the credit window.
BATCH_BODIES = 1000  # bodies per send_many call


def _credentials() -> dict:
    """The benchmark user's, when the parent runs an authenticating broker (the 64b_auth workload)."""
    user = os.environ.get("QFLOW_BENCH_USER")
    return {} if user is None else {"username": user, "password": os.environ["QFLOW_BENCH_PASSWORD"]}


async def _produce(port: int, queue: str, count: int, size: int, capacity: int, style: str = "each",
                   durable: bool = False) -> None:
    async with await qflow.connect("127.0.0.1", port, **_credentials()) as conn:
        ssn = await conn.session()
        sender = ssn.sender(queue, capacity=capacity, durable=durable)
        body = b"x" * size
        bodies = [body] * BATCH_BODIES
        _ready()
        t0 = time.perf_counter()
        if style == "batch":
            left = count
            while left:
                left -= await sender.send_many(bodies[:left])
        else:
            send = sender.send
            for _ in range(count):
                await send(body)
        await sender.sync()
        print(f"RESULT {t0!r}", flush=True)


async def _consume(port: int, queue: str, count: int, capacity: int, rate: float | None = None,
                   style: str = "each") -> None:
    async with await qflow.connect("127.0.0.1", port, **_credentials()) as conn:
        ssn = await conn.session()
        receiver = await ssn.receiver(queue, capacity=capacity, accept="auto", rate=rate)
        _ready()
        # Every body is read, as an application reads its messages: a received
        # message's fields are read from its frame only when asked for, so a
        # consumer that never asks measures less than any real one (and less
        # than bench/compare's, which must look for its END marker).
        if style == "batch":
            fetch_many = receiver.fetch_many
            left = count
            while left:
                left -= len([m.body for m in await fetch_many(left, timeout=60)])
        else:
            fetch = receiver.fetch
            for _ in range(count):
                (await fetch(timeout=60)).body  # noqa: B018 - read, as an application would
        t_last = time.perf_counter()
        await receiver.close()
        await ssn.sync()
        print(f"RESULT {t_last!r}", flush=True)


def client_main(argv: list[str]) -> None:
    role, port, queue, count, size, capacity = argv[0], int(argv[1]), argv[2], int(argv[3]), int(argv[4]), int(argv[5])
    rate = float(argv[6]) or None
    style = argv[7]
    durable = argv[8] == "durable"
    if role == "produce":
        trio.run(_produce, port, queue, count, size, capacity, style, durable)
    else:
        trio.run(_consume, port, queue, count, capacity, rate, style)


def _client(role: str, port: int, queue: str, count: int, size: int, capacity: int = 1000,
            rate: float = 0, style: str = "each", env: dict | None = None, durable: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--client", role, str(port), queue, str(count), str(size),
                             str(capacity), str(rate), style, "durable" if durable else "transient"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def run_clients(*procs: subprocess.Popen, cpu: list[float] | None = None) -> list[float]:
    """Wait until every client is READY, say go to all, return each one's RESULT
    time (time.perf_counter, the same monotonic clock in every process).
    ``cpu``: each client's CPU seconds, from READY to RESULT, are appended to it."""
    try:
        for proc in procs:
            _expect(proc, "READY")
        before = [cpu_seconds(proc.pid) for proc in procs] if cpu is not None else []
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [float(_expect(proc, "RESULT")) for proc in procs]
        if cpu is not None:
            cpu += [cpu_seconds(proc.pid) - b for proc, b in zip(procs, before, strict=True)]
        for proc in procs:
            proc.stdin.close()
            if proc.wait():
                raise SystemExit("a benchmark client failed")
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


async def _query(port: int, queue: str, credentials: dict | None = None) -> dict:
    async with await qflow.connect("127.0.0.1", port, **(credentials or {})) as conn:
        return await (await conn.session()).query_queue(queue)


def throughput(count: int, size: int, arguments: dict | None = None, env: dict | None = None,
               consumer_rate: float = 0, style: str = "each", auth: bool = False, acl: bool = False,
               durable: bool = False) -> dict:
    """One producer and one consumer through one queue: msgs/s end to end, from
    the producer's first send to the consumer's last fetch (both processes
    started and connected before, as bench/compare measures). ``auth``: the
    broker runs --auth yes and both clients log in with SCRAM-SHA-256; ``acl``:
    and the broker checks bench/auth.py's BENCH_ACL (--acl-file). ``durable``:
    a durable queue and a durable sender, so every message is persistent (each
    qflowd has a fresh temporary data directory)."""
    from auth import PASSWORD, USER, acl_file, users_file  # noqa: E402 - bench/ is not a package

    with tempfile.TemporaryDirectory(prefix="qflow-bench-") as tmp:
        args = ("--auth", "yes", "--sasl-db", users_file(tmp)) if auth else ()
        if acl:
            args += ("--acl-file", acl_file(tmp))
        d = start_broker(*args, env=env)
        credentials = {"username": USER, "password": PASSWORD} if auth else {}
        client_env = {"QFLOW_BENCH_USER": USER, "QFLOW_BENCH_PASSWORD": PASSWORD} if auth else None
        try:
            return _throughput(d, count, size, arguments, consumer_rate, style, credentials, client_env, durable)
        finally:
            d.stop()


def _throughput(d: qflowd.Daemon, count: int, size: int, arguments: dict | None, consumer_rate: float, style: str,
                credentials: dict, client_env: dict | None, durable: bool = False) -> dict:
    proc, port = d.proc, d.port
    trio.run(_declare, port, "bench", arguments or {}, credentials, durable)
    consumer = _client("consume", port, "bench", count, size, rate=consumer_rate, style=style, env=client_env)
    producer = _client("produce", port, "bench", count, size, style=style, env=client_env, durable=durable)
    # From the producer's first send to the consumer's last fetch.
    clients_cpu: list[float] = []
    broker_cpu = cpu_seconds(proc.pid)
    t_last, t0 = run_clients(consumer, producer, cpu=clients_cpu)
    broker_cpu = cpu_seconds(proc.pid) - broker_cpu  # with the clients' connecting: small beside the run
    elapsed = t_last - t0
    stats = trio.run(_query, port, "bench", credentials)
    # CPU per message, which a loaded machine disturbs far less than the wall clock (clock ticks: 10 ms).
    return {"msgs_per_s": round(count / elapsed), "seconds": round(elapsed, 3),
            "broker_cpu_us": round(broker_cpu / count * 1e6, 3), "clients_cpu_us": round(sum(clients_cpu) / count * 1e6, 3),
            "broker_peak_rss": rss_peak_bytes(proc.pid), "flow_stopped_count": stats["flowStoppedCount"]}


def rss_now(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def queued_memory(count: int) -> dict:
    """Broker RSS per queued 64-byte message, with ``count`` messages queued."""
    d = start_broker()
    proc, port = d.proc, d.port
    try:
        trio.run(_declare, port, "held", {"qpid.max_size": 0, "qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0})
        before = rss_now(proc.pid)
        run_clients(_client("produce", port, "held", count, 64))
        after = rss_now(proc.pid)
        return {"rss_bytes_per_queued_msg": round((after - before) / count, 1), "queued": count,
                "broker_rss_bytes": after}
    finally:
        d.stop()


RECOVERED_LOG = re.compile(r"recovered (\d+) messages on \d+ queues from .* in ([0-9.]+) ms")


def recovery(count: int) -> dict:
    """The restart of a qflowd whose durable queue holds ``count`` persistent
    64-byte messages: seconds from launching it until it listens and the
    queue's msgDepth is ``count``. The queue is filled by a durable sender
    (send_many), and the broker is SIGKILLed once every transfer completed,
    so every message is on disk and nothing was shut down cleanly. Also: the
    broker's own logged recovery time (the journal read and the queue refilled),
    and the same launch with an empty data directory (Python's start-up and
    imports, which the restart includes)."""
    data_dir = tempfile.mkdtemp(prefix="qflow-bench-recovery-")
    log = os.path.join(tempfile.mkdtemp(prefix="qflow-bench-recovery-log-"), "qflowd.log")
    try:
        t0 = time.perf_counter()
        empty = qflowd.start("--log-level", "warning", "--data-dir", os.path.join(data_dir, "empty"))
        startup_empty = time.perf_counter() - t0
        empty.stop()
        d = qflowd.start("--log-level", "warning", "--data-dir", data_dir)
        try:
            trio.run(_declare, d.port, "held", NO_FLOW, None, True)
            # The producer returns once every transfer completed (Sender.sync): all of them are on disk.
            run_clients(_client("produce", d.port, "held", count, 64, style="batch", durable=True))
        finally:
            d.kill()
        t0 = time.perf_counter()
        d = qflowd.start("--log-level", "info", "--data-dir", data_dir, log=log, timeout=300)
        try:
            listening = time.perf_counter() - t0
            depth = trio.run(_query, d.port, "held")["msgDepth"]
            total = time.perf_counter() - t0
            if depth != count:
                raise SystemExit(f"recovery: {depth} messages back on the queue, {count} were completed")
            m = RECOVERED_LOG.search(d.log())
            if m is None or int(m.group(1)) != count:
                raise SystemExit(f"recovery: qflowd did not log the recovery of {count} messages: {d.log()!r}")
            return {"recovery_s": round(total, 3), "listening_s": round(listening, 3),
                    "broker_logged_s": round(float(m.group(2)) / 1000, 3), "startup_empty_s": round(startup_empty, 3),
                    "messages": count, "journal_bytes": _tree_bytes(data_dir)}
        finally:
            d.stop()
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(os.path.dirname(log), ignore_errors=True)


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def method_line(count: int, rounds: int) -> str:
    """How the throughput figures below it were measured, in the words
    bench/compare uses for its own (bench/README.md compares the two)."""
    return (f"method: 1 producer + 1 consumer process, capacity 1000, credit 1000, accept=auto, no flow control "
            "unless the name says so;\n"
            f"  Sender.send / Receiver.fetch one message per call (_batch: send_many of {BATCH_BODIES} bodies / "
            "fetch_many), every body read; msg/s = count / (first send -> last fetch); the median of the rounds.\n"
            f"  Unlike bench/compare: a fixed count of {count} msgs per run (1k: {count // 2}, flow_cycling: "
            f"{count // 3}), a fresh qflowd for every run and no other broker beside it, {rounds} round(s).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="a few seconds: check the benchmarks still run")
    parser.add_argument("--count", type=int, default=0, help="messages per throughput run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", default="",
                        help="only these throughput workloads (comma-separated, e.g. 64b), and none of the "
                             "release, memory and core measurements; 'latency': only the latency points")
    parser.add_argument("--latency-duration", type=float, default=0,
                        help="counted seconds per latency point (default 30; smoke 0.3)")
    parser.add_argument("--latency-warmup", type=float, default=0,
                        help="seconds at the rate before counting (default 2; smoke 0.1)")
    args = parser.parse_args()
    count = args.count or (2000 if args.smoke else 300_000)
    rounds = 1 if args.smoke else args.rounds
    spin_before = spin_loop()
    no_flow = NO_FLOW
    idle_flow = {"qpid.flow_stop_count": 100_000_000, "qpid.max_size": 0}
    cycling = {"qpid.flow_stop_count": 2000, "qpid.flow_resume_count": 1000, "qpid.max_size": 0}
    workloads = {
        "64b": lambda: throughput(count, 64, no_flow),
        "64b_flow_idle": lambda: throughput(count, 64, idle_flow),
        "64b_python_accounting": lambda: throughput(count, 64, no_flow, env={"QFLOW_ACCOUNTING": "python"}),
        "1k": lambda: throughput(count // 2, 1024, no_flow),
        # the same on a durable queue from a durable sender: every message is persistent
        "64b_persistent": lambda: throughput(count, 64, no_flow, durable=True),
        "1k_persistent": lambda: throughput(count // 2, 1024, no_flow, durable=True),
        "64b_batch": lambda: throughput(count, 64, no_flow, style="batch"),
        "1k_batch": lambda: throughput(count // 2, 1024, no_flow, style="batch"),
        # a consumer held to 20k msgs/s: the queue cycles between its thresholds
        "64b_flow_cycling": lambda: throughput(count // 3, 64, cycling, consumer_rate=20_000),
        # both clients logged in with SCRAM-SHA-256 on a --auth yes broker: the same per-message path
        "64b_auth": lambda: throughput(count, 64, no_flow, auth=True),
        # the same with an ACL file: publish decided once per session and routing key
        "64b_acl": lambda: throughput(count, 64, no_flow, auth=True, acl=True),
    }
    only = [w for w in args.workloads.split(",") if w]
    sys.path.insert(0, HERE)
    import latency  # noqa: E402 - bench/ is not a package

    # The smoke run: 10k msg/s only (the same code as every rate), a third of a second.
    latency_rates = (10_000,) if args.smoke else latency.RATES
    latency_duration = args.latency_duration or (0.3 if args.smoke else 30)
    latency_warmup = args.latency_warmup or (0.1 if args.smoke else 2)
    if only == ["latency"]:
        points = latency.measure(latency_duration, latency_warmup, latency_rates)
        print(latency.table(points))
        print(json.dumps({**latency.json_keys(points), "latency_seconds": latency_duration,
                          "latency_warmup_s": latency_warmup,
                          "spin_loop_s": [round(spin_before, 3), round(spin_loop(), 3)]}))
        return
    for name in only:
        if name not in workloads:
            raise SystemExit(f"unknown workload {name!r}: choose from {', '.join(workloads)}")
    if only:
        workloads = {name: workloads[name] for name in only}
    results: dict[str, list[dict]] = {name: [] for name in workloads}
    spins = []  # the probe at the start of each round: how fast the machine was for that round's runs
    for _ in range(rounds):  # interleaved: A B C ... A B C ...
        spins.append(spin_loop())
        for name, run in workloads.items():
            results[name].append(run())
    med = {k: statistics.median(r["msgs_per_s"] for r in v) for k, v in results.items()}

    def paired(a: str, b: str) -> float:
        """Median over rounds of a/b, each ratio from runs next to each other."""
        return statistics.median(x["msgs_per_s"] / y["msgs_per_s"] for x, y in zip(results[a], results[b], strict=True))

    def cpu_ratio(a: str, b: str) -> float | None:
        """Median over rounds of the broker's CPU per message of a over b; None when
        no run was long enough for the CPU clock's ticks (10 ms) to count (the smoke run)."""
        ratios = [x["broker_cpu_us"] / y["broker_cpu_us"]
                  for x, y in zip(results[a], results[b], strict=True) if x["broker_cpu_us"] and y["broker_cpu_us"]]
        return round(statistics.median(ratios), 3) if ratios else None

    print(method_line(count, rounds))
    for name, runs in results.items():
        print(f"{name:>22}: " + "  ".join(f"{r['msgs_per_s']:>8} msg/s" for r in runs) + f"   median {med[name]:.0f}")
    print(f"{'spin loop, each round':>22}: " + "  ".join(f"{s:>8.3f} s    " for s in spins)
          + f"   before the run {spin_before:.3f} s (lower: a faster machine)")
    if only:
        # The persistent goal's ratios, when both sides of one were run.
        ratios = {}
        for size in ("64b", "1k"):
            if size in workloads and f"{size}_persistent" in workloads:
                ratios[f"persistent_over_transient_{size}"] = round(paired(f"{size}_persistent", size), 3)
                ratios[f"broker_cpu_persistent_over_transient_{size}"] = cpu_ratio(f"{size}_persistent", size)
        ratios["broker_cpu_us"] = {name: statistics.median(r["broker_cpu_us"] for r in runs)
                                   for name, runs in results.items()}
        ratios["clients_cpu_us"] = {name: statistics.median(r["clients_cpu_us"] for r in runs)
                                    for name, runs in results.items()}
        print(json.dumps({**{f"msgs_per_s_{name}": med[name] for name in workloads}, **ratios,
                          "count": count, "rounds": rounds,
                          "spin_loop_s": [round(spin_before, 3), round(spin_loop(), 3)],
                          "spin_loop_s_rounds": [round(s, 3) for s in spins]}))
        return
    print(f"{'flow cycles':>22}: {[r['flow_stopped_count'] for r in results['64b_flow_cycling']]}")
    print(f"{'persistent / transient':>22}: 64b {paired('64b_persistent', '64b'):.3f}, "
          f"1k {paired('1k_persistent', '1k'):.3f} (median of the rounds' pairs; the goal: 0.5 or more)")
    from release import measure  # noqa: E402 - bench/ is not a package

    release = measure(rounds=5 if args.smoke else 30, held=1000 if args.smoke else 10_000)
    print(f"{'release of held':>22}: {release}")
    memory = queued_memory(20_000 if args.smoke else 1_000_000)
    print(f"{'queued memory':>22}: {memory}")
    recovered = recovery(20_000 if args.smoke else 1_000_000)
    print(f"{'recovery':>22}: {recovered}")
    from core import measure as measure_core  # noqa: E402

    core = measure_core(count=5_000 if args.smoke else 200_000, rounds=1 if args.smoke else 3)
    print(f"{'broker core, no I/O':>22}: {core}")
    from auth import measure as measure_auth  # noqa: E402

    connect = measure_auth(rounds=5 if args.smoke else 40)
    print(f"{'connection setup':>22}: {connect}")
    points = latency.measure(latency_duration, latency_warmup, latency_rates)
    print(f"latency: 1 producer at a fixed rate (64 B, one send per message, on a fixed timeline), 1 consumer "
          f"(fetch), a fresh qflowd each;\n  {latency_duration:g} s counted per point after {latency_warmup:g} s; "
          "send call -> fetch returned, CLOCK_MONOTONIC (bench/README.md, Latency)")
    print(latency.table(points))
    spin_after = spin_loop()
    release_kind = "native" if "native" in release else "python"
    out = {
        "msgs_per_s_64b": med["64b"],
        "msgs_per_s_1k": med["1k"],
        "msgs_per_s_64b_persistent": med["64b_persistent"],
        "msgs_per_s_1k_persistent": med["1k_persistent"],
        "persistent_over_transient_64b": round(paired("64b_persistent", "64b"), 3),
        "persistent_over_transient_1k": round(paired("1k_persistent", "1k"), 3),
        "broker_cpu_persistent_over_transient_64b": cpu_ratio("64b_persistent", "64b"),
        "broker_cpu_persistent_over_transient_1k": cpu_ratio("1k_persistent", "1k"),
        "recovery_1m_s": recovered["recovery_s"],
        "recovery_1m_broker_logged_s": recovered["broker_logged_s"],
        "recovery_messages": recovered["messages"],
        "msgs_per_s_64b_batch": med["64b_batch"],
        "msgs_per_s_1k_batch": med["1k_batch"],
        "flow_idle_overhead_pct": round(100 * (1 - paired("64b_flow_idle", "64b")), 1),
        "native_over_python_accounting": round(1 / paired("64b_python_accounting", "64b"), 3),
        "msgs_per_s_64b_flow_cycling": med["64b_flow_cycling"],
        "flow_cycles": max(r["flow_stopped_count"] for r in results["64b_flow_cycling"]),
        "release_median_ms": release[release_kind]["median_ms"],
        "release_p99_ms": release[release_kind]["p99_ms"],
        "release_python_p99_ms": release["python"]["p99_ms"],
        "rss_bytes_per_queued_msg": memory["rss_bytes_per_queued_msg"],
        "broker_rss_1m_queued": memory["broker_rss_bytes"],
        "broker_core_us_per_msg": core["us_per_msg"],
        **connect,
        "msgs_per_s_64b_auth": med["64b_auth"],
        "auth_over_anonymous_throughput": round(paired("64b_auth", "64b"), 3),
        "msgs_per_s_64b_acl": med["64b_acl"],
        "acl_over_auth_throughput": round(paired("64b_acl", "64b_auth"), 3),
        "broker_peak_rss_64b": max(r["broker_peak_rss"] for r in results["64b"]),
        **latency.json_keys(points),
        "latency_seconds": latency_duration,
        "latency_warmup_s": latency_warmup,
        "count": count,
        "rounds": rounds,
        "spin_loop_s": [round(spin_before, 3), round(spin_after, 3)],
        "spin_loop_s_rounds": [round(s, 3) for s in spins],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--client":
        client_main(sys.argv[2:])
    else:
        main()
