"""``bench/compare``'s latency workload: qpidd and qflowd side by side, each
with its own command-line tools, in one run.

qpidd (built by ../shared/anchors/build-qpidd.sh; clients speak AMQP 0-10,
qpid::messaging's default) with ``qpid-send --send-rate R --timestamp yes``
and ``qpid-receive --report-total``; qflowd with ``qflow-send --send-rate R
--timestamp yes`` and ``qflow-receive --report-total``. Both senders put their
send time (ns since the epoch) in the property ``ts``; both receivers print
``tp(m/s) l-min l-max l-avg``, the latencies in ms from that stamp to the
message's arrival. The same rates, message size (64 B), count, capacity (1000)
and ack frequency (100, both tools' default) on both sides; for every rate
and round the two sides run back to back, the first side alternating by
round. The receiver is subscribed before the sender starts.

Transient only: this qpidd build has no store module.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

from .brokers import free_port, proc_tree_cpu

QPID_BUILD = os.path.expanduser("~/.cache/qflow-anchors/qpid-cpp")
RATES = (1_000, 10_000, 50_000)
SIZE = 64
CLIENT_TIMEOUT = 120


def qpid_tools(build: str) -> dict[str, str] | None:
    """The build's qpidd, amqp.so, qpid-send and qpid-receive, or None when one is missing."""
    paths = {"qpidd": os.path.join(build, "src", "qpidd"), "amqp": os.path.join(build, "src", "amqp.so"),
             "send": os.path.join(build, "src", "tests", "qpid-send"),
             "receive": os.path.join(build, "src", "tests", "qpid-receive")}
    return paths if all(os.path.exists(p) for p in paths.values()) else None


class QpiddSide:
    """A private qpidd on 127.0.0.1: no data directory, no authentication, its log in a temporary file;
    ``extra``: more of qpidd's options."""

    name = "qpidd"

    def __init__(self, tools: dict[str, str], log, extra: list[str] | tuple[str, ...] = ()) -> None:
        import tempfile

        self.tools = tools
        self.port = free_port()
        self.logfile = tempfile.NamedTemporaryFile(prefix="qflow-bench-qpidd-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [tools["qpidd"], "--load-module", tools["amqp"], "--no-module-dir", "--auth", "no", "--no-data-dir",
             "--interface", "127.0.0.1", "--port", str(self.port), "--log-enable", "warning+",
             "--log-to-stderr", "no", "--log-to-file", self.logfile.name, *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 20
        while not _listening(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"qpidd did not start: {open(self.logfile.name).read()[-2000:]!r}")
            time.sleep(0.05)
        log(f"qpidd ready on 127.0.0.1:{self.port} (pid {self.pid})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        os.unlink(self.logfile.name)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _totals(out: str) -> dict[str, float]:
    """The last header and value lines of a --report-total, as a map (tp(m/s), l-min, l-max, l-avg)."""
    lines = [line.split() for line in out.splitlines() if line.strip()]
    for i in range(len(lines) - 1, 0, -1):
        if lines[i - 1] and lines[i - 1][0] == "tp(m/s)":
            return dict(zip(lines[i - 1], map(float, lines[i]), strict=False))
    raise RuntimeError(f"no --report-total in the output: {out[-500:]!r}")


def _finish(proc: subprocess.Popen, what: str, deadline: float) -> str:
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{what} did not finish in time") from None
    if proc.returncode:
        raise RuntimeError(f"{what} exited {proc.returncode}: {err[-500:]!r}")
    return out


def _qpidd_run(side: QpiddSide, queue: str, rate: int, count: int) -> tuple[str, str]:
    t, url = side.tools, f"127.0.0.1:{side.port}"
    ready = f"{queue}-ready"
    common = ["-b", url, "--report-total"]
    receiver = subprocess.Popen([t["receive"], *common, "-a", f"{queue}; {{create: always}}", "--messages",
                                 str(count), "--timeout", "30", "--print-content", "no",
                                 "--ready-address", f"{ready}; {{create: always}}"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + CLIENT_TIMEOUT
    try:
        # The receiver's ready message says its subscription exists: only then does the sender start.
        _finish(subprocess.Popen([t["receive"], "-b", url, "-a", f"{ready}; {{create: always, delete: receiver}}",
                                  "--messages", "1", "--timeout", "20", "--print-content", "no"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                "qpid-receive (ready)", deadline)
        sender = subprocess.Popen([t["send"], *common, "-a", queue, "--messages", str(count), "--content-size",
                                   str(SIZE), "--send-rate", str(rate), "--timestamp", "yes"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return _finish(sender, "qpid-send", deadline), _finish(receiver, "qpid-receive", deadline)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()


def _qflow_run(qside, queue: str, rate: int, count: int) -> tuple[str, str]:
    qside.setup([queue], {})
    url = f"127.0.0.1:{qside.port}"
    common = ["-b", url, "--report-total", "-a", queue]
    receiver = subprocess.Popen([sys.executable, "-m", "qflow.cli.qflow_receive", *common, "--messages", str(count),
                                 "--timeout", "30", "--print-content", "no"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + CLIENT_TIMEOUT
    try:
        while not _consumers(qside, queue):  # the receiver's subscription exists: the sender may start
            if receiver.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"qflow-receive did not subscribe: {receiver.communicate()[1][-500:]!r}")
            time.sleep(0.02)
        sender = subprocess.Popen([sys.executable, "-m", "qflow.cli.qflow_send", *common, "--messages", str(count),
                                   "--content-size", str(SIZE), "--send-rate", str(rate), "--timestamp", "yes"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return _finish(sender, "qflow-send", deadline), _finish(receiver, "qflow-receive", deadline)
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
        qside.teardown([queue])


def _consumers(qside, queue: str) -> int:
    async def fn(ssn):
        return (await ssn.query_queue(queue))["consumerCount"]

    return qside._admin(fn)


def run_latency(args, qside, pside: QpiddSide, log, probe) -> dict:
    """Every rate, ``args.rounds`` rounds of one qpidd run and one qflowd run
    (the first side alternating), ``args.latency_duration`` seconds each.
    Returns {rate: {side: [run, ...]}} and the probes, as ``latency_table`` reads them."""
    rates = [int(r) for r in args.latency_rates.split(",")]
    results: dict = {"runs": {r: {"qpidd": [], "qflow": []} for r in rates}, "spins": [], "failures": []}
    n = 0
    for rate in rates:
        count = max(1, round(rate * args.latency_duration))
        for rnd in range(args.rounds):
            results["spins"].append(probe())
            order = ["qpidd", "qflow"] if rnd % 2 == 0 else ["qflow", "qpidd"]
            for name in order:
                n += 1
                queue = f"lat-{os.getpid()}-{n}"
                pid = pside.pid if name == "qpidd" else qside.pid
                cpu = proc_tree_cpu(pid)
                try:
                    sent, got = (_qpidd_run(pside, queue, rate, count) if name == "qpidd"
                                 else _qflow_run(qside, queue, rate, count))
                    s, g = _totals(sent), _totals(got)
                    if "l-avg" not in g:
                        raise RuntimeError(f"the receiver printed no latencies: {got[-300:]!r}")
                except RuntimeError as exc:
                    results["failures"].append(f"latency {rate} round {rnd + 1} {name}: {exc}")
                    log(f"latency {rate:>6} msg/s round {rnd + 1} {name:>6}: FAILED: {str(exc)[:300]}")
                    continue
                r = {"count": count, "send_rate": s["tp(m/s)"], "receive_rate": g["tp(m/s)"],
                     "min_ms": g["l-min"], "max_ms": g["l-max"], "avg_ms": g["l-avg"],
                     "broker_cpu_s": round(proc_tree_cpu(pid) - cpu, 2)}
                results["runs"][rate][name].append(r)
                log(f"latency {rate:>6} msg/s round {rnd + 1} {name:>6}: avg {r['avg_ms']} ms, max {r['max_ms']} "
                    f"ms, min {r['min_ms']} ms; sent at {r['send_rate']:.0f} msg/s; broker cpu {r['broker_cpu_s']} s")
    return results


def summary(results: dict) -> dict:
    """Per rate and side: the median over the rounds of avg and min, the largest max, the median send rate;
    and qflow / qpidd of the avg and the max (below 1: qflow's latency is lower)."""
    out = {}
    for rate, sides in results["runs"].items():
        row = {}
        for name, runs in sides.items():
            if runs:
                row[name] = {"avg_ms": round(statistics.median(r["avg_ms"] for r in runs), 3),
                             "max_ms": max(r["max_ms"] for r in runs),
                             "min_ms": round(statistics.median(r["min_ms"] for r in runs), 3),
                             "send_rate": round(statistics.median(r["send_rate"] for r in runs)),
                             "broker_cpu_s": round(statistics.median(r["broker_cpu_s"] for r in runs), 2),
                             "rounds": len(runs)}
        if "qpidd" in row and "qflow" in row:
            row["avg_qflow_over_qpidd"] = round(row["qflow"]["avg_ms"] / max(row["qpidd"]["avg_ms"], 1e-3), 3)
            row["max_qflow_over_qpidd"] = round(row["qflow"]["max_ms"] / max(row["qpidd"]["max_ms"], 1e-3), 3)
        out[str(rate)] = row
    return out


def latency_table(results: dict, args) -> str:
    lines = [f"latency beside qpidd: each broker with its own tools (qpid-send/-receive over AMQP 0-10; qflow-send/"
             f"-receive), --send-rate R --timestamp yes, 64 B, {args.latency_duration:g} s per run, "
             f"{args.rounds} round(s);",
             "  ms from the sender's ts stamp (wall clock) to arrival, as each receiver's --report-total prints; "
             "avg, min: median of the rounds; max: the largest",
             f"{'rate':>8}  {'side':>6}  {'avg ms':>8}  {'max ms':>8}  {'min ms':>8}  {'sent msg/s':>10}  "
             f"{'broker CPU s':>12}"]
    for rate, row in summary(results).items():
        for name in ("qpidd", "qflow"):
            if name in row:
                r = row[name]
                lines.append(f"{rate:>8}  {name:>6}  {r['avg_ms']:>8.2f}  {r['max_ms']:>8.2f}  {r['min_ms']:>8.2f}  "
                             f"{r['send_rate']:>10}  {r['broker_cpu_s']:>12}")
        if "avg_qflow_over_qpidd" in row:
            lines.append(f"{'':>8}  qflow/qpidd: avg {row['avg_qflow_over_qpidd']}, max {row['max_qflow_over_qpidd']}")
    if results["spins"]:
        lines.append(f"  spin loop before each round: {min(results['spins']):.3f}-{max(results['spins']):.3f} s")
    return "\n".join(lines)
