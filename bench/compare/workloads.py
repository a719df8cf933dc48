"""The workloads of ``bench/compare``: what each one declares on a broker, which
client processes it starts with which settings, what it checks and what it
measures; and the order they run in (interleaved rounds, the client bake-off).
bench/README.md describes each workload for both sides."""

from __future__ import annotations

import collections
import json
import os
import queue as queue_mod
import statistics
import subprocess
import sys
import threading
import time

from .brokers import proc_tree_cpu

PACKAGE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(PACKAGE))

RABBIT_LIBS = ("py-amqp", "pika", "aio-pika")
SIZES = {"64b": 64, "1k": 1024}

# Queue arguments. Throughput workloads: no limit and no flow control on either
# side (RabbitMQ's default; qflow's default 100 MiB limit with flow at 80 % is
# switched off, as bench/run.py does).
QFLOW_PLAIN = {"qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0, "qpid.max_size": 0}
# The flow workload: a hard bound of 3000 messages on both sides; qflow stops
# producers above 900 (900 + 2 senders x 1000 capacity <= 3000, so nothing is
# ever refused), RabbitMQ refuses (nacks) above 3000 and producers resend.
FLOW_MAX, FLOW_STOP, FLOW_RESUME = 3000, 900, 700
QFLOW_FLOW = {"qpid.max_count": FLOW_MAX, "qpid.max_size": 0, "qpid.flow_stop_count": FLOW_STOP,
              "qpid.flow_resume_count": FLOW_RESUME}
RABBIT_FLOW = {"x-max-length": FLOW_MAX, "x-overflow": "reject-publish"}
# The back-pressure comparison (the numbers).
BP_WINDOWS = (50, 13, 149)
BP_COUNTS = (1213, 797, 331)
BP_MAX = 373
BP_PREFETCH = 10  # the consumer's credit/prefetch: a round trip per message would cap the rate under load
BP_STOP, BP_RESUME = 160, 140  # 160 + 50 + 13 + 149 = 372 <= 373
QFLOW_BP = {"qpid.max_count": BP_MAX, "qpid.max_size": 0, "qpid.flow_stop_count": BP_STOP,
            "qpid.flow_resume_count": BP_RESUME}
RABBIT_BP = {"x-max-length": BP_MAX, "x-overflow": "reject-publish"}


class ClientRun:
    """Start client processes, wait until all are READY, say go, collect results."""

    def __init__(self, specs: list[dict], timeout: float) -> None:
        self.specs = specs
        self.timeout = timeout
        self.lines: queue_mod.Queue = queue_mod.Queue()
        self.procs: list[subprocess.Popen] = []

    def _reader(self, i: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put((i, line.rstrip("\n")))
        self.lines.put((i, None))

    def _collect(self, want: str, which: set[int], deadline: float) -> dict[int, str]:
        got: dict[int, str] = {}
        while which - set(got):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"clients {sorted(which - set(got))} gave no {want} in time")
            try:
                i, line = self.lines.get(timeout=remaining)
            except queue_mod.Empty:
                continue
            if line is None:
                if i in which and i not in got:
                    raise RuntimeError(f"client {i} ({self.specs[i]['lib']} {self.specs[i]['role']}) exited "
                                       f"with status {self.procs[i].wait()} before {want}")
                continue
            if line.startswith(want) and i in which:
                got[i] = line[len(want):].strip()
            elif line:
                print(f"  [client {i}] {line}", file=sys.stderr)
        return got

    def run(self, on_go=None) -> list[dict]:
        try:
            for i, spec in enumerate(self.specs):
                proc = subprocess.Popen([sys.executable, PACKAGE, "--client", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
                self.procs.append(proc)
                threading.Thread(target=self._reader, args=(i, proc), daemon=True).start()
            everyone = set(range(len(self.specs)))
            self._collect("READY", everyone, time.monotonic() + 60)
            if on_go:
                on_go()
            order = sorted(everyone, key=lambda i: {"consume": 0, "monitor": 1, "produce": 2}[self.specs[i]["role"]])
            for i in order:
                self.procs[i].stdin.write("go\n")
                self.procs[i].stdin.flush()
            workers = {i for i in everyone if self.specs[i]["role"] != "monitor"}
            results = self._collect("RESULT", workers, time.monotonic() + self.timeout + 15)
            for i in everyone - workers:  # monitors: stop now
                self.procs[i].stdin.write("stop\n")
                self.procs[i].stdin.flush()
            results.update(self._collect("RESULT", everyone - workers, time.monotonic() + 15))
            for proc in self.procs:
                proc.stdin.close()
                proc.wait(timeout=15)
            return [dict(json.loads(results[i]), lib=self.specs[i]["lib"]) for i in range(len(self.specs))]
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


class Bench:
    """The runs of one ``bench/compare`` invocation and what they measured:
    ``results[workload_size][lib]`` (throughput runs), ``bp[lib]`` (back-pressure
    runs), ``best[workload_size]`` (the fastest RabbitMQ client) and ``failures``."""

    def __init__(self, args, qside, rside, log, probe) -> None:
        self.args = args
        self.probe = probe  # bench/run.py's spin loop: seconds it takes now
        self.spins: dict[str, list[float]] = collections.defaultdict(list)  # per workload, one per round
        self.sides = {"qflow": qside, "rabbitmq": rside}
        self.log = log
        self.seq = 0
        self.results: dict[str, dict[str, list[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
        self.bp: dict[str, list[dict]] = collections.defaultdict(list)
        self.best: dict[str, str] = {}
        self.failures: list[str] = []

    def run_throughput(self, workloads: list[str], available: list[str]) -> None:
        args, log, results, best = self.args, self.log, self.results, self.best
        finalists: dict[str, list[str]] = {}  # size -> the clients carried past the bake-off
        for workload in [w for w in workloads if w != "backpressure"]:
            for size_name in SIZES:
                key = f"{workload}_{size_name}"
                # The client bake-off is the 1p1c workload (every client); the others run with
                # the winner and any client within --close of it.
                cands = available if workload == "1p1c" else finalists.get(size_name, available)
                for rnd in range(args.rounds):
                    self.spins[key].append(self.probe())
                    for lib in ["qflow", *cands]:  # interleaved: A B [B' B''] A B ...
                        try:
                            r = self.throughput(workload, size_name, lib)
                        except RuntimeError as exc:  # one failed run: say so, and go on
                            self.failures.append(f"{key} round {rnd + 1} {lib}: {exc}")
                            log(f"{key:>12} round {rnd + 1} {lib:>8}: FAILED: {str(exc)[:300]}")
                            continue
                        r["round"] = rnd
                        results[key][lib].append(r)
                        extra = f", {r['resends']} resends" if r["resends"] else ""
                        extra += f", {r['flow_stops']} flow stops" if r.get("flow_stops") else ""
                        extra += f", consumer rested {r['consumer_rested']:.0%}" if "consumer_rested" in r else ""
                        log(f"{key:>12} round {rnd + 1} {lib:>8}: {r['msgs_per_s']:>8} msg/s "
                            f"({r['count']} in {r['seconds']} s, broker cpu {r['broker_cpu_s']} s, "
                            f"the other broker idle beside it {r['idle_broker_cpu_s']} s{extra})")
                speed = {c: statistics.median(x["msgs_per_s"] for x in results[key][c])
                         for c in cands if results[key][c]}
                if not speed:
                    continue
                best[key] = max(speed, key=speed.__getitem__)
                if workload == "1p1c":
                    finalists[size_name] = [c for c in speed if speed[c] >= (1 - args.close) * speed[best[key]]]
                    log(f"{key}: fastest RabbitMQ client {best[key]}; carried on: {', '.join(finalists[size_name])}")

    def run_backpressure(self, available: list[str]) -> None:
        bp_lib = self.best.get("1p1c_64b", available[0])
        for rnd in range(self.args.rounds):
            for lib in ("qflow", bp_lib):
                try:
                    r = self.backpressure(lib)
                except RuntimeError as exc:
                    self.failures.append(f"back-pressure round {rnd + 1} {lib}: {exc}")
                    self.log(f"back-pressure round {rnd + 1} {lib:>8}: FAILED: {str(exc)[:300]}")
                    continue
                self.bp[lib].append(r)
                self.log(f"back-pressure round {rnd + 1} {lib:>8}: {json.dumps(r)}")

    def _run_on(self, side, specs: list[dict], queues: list[str], arguments: dict,
                fanout: str | None = None, durable: bool = False) -> tuple[list[dict], float, float, dict]:
        """Declare the queues, run the clients, delete the queues: (the clients'
        results, the broker's CPU seconds from go to the last result, the other
        broker's meanwhile, the broker's stats)."""
        # The other broker idles beside every run (make bench has no such
        # neighbour): its CPU is part of the load the run saw.
        pids = {name: s.pid for name, s in self.sides.items()}
        cpu0: dict[str, float] = {}
        side.setup(queues, arguments, fanout, durable)
        try:
            results = ClientRun(specs, self.args.client_timeout).run(
                on_go=lambda: cpu0.update({n: proc_tree_cpu(p) for n, p in pids.items()}))
            cpu = {n: proc_tree_cpu(p) - cpu0[n] for n, p in pids.items()}
        finally:
            stats = side.teardown(queues, fanout)
        (other,) = [n for n in pids if n != side.name]
        return results, cpu[side.name], cpu[other], stats

    def throughput(self, workload: str, size_name: str, lib: str) -> dict:
        """One run of a throughput workload on one side: producers publish for
        --duration seconds, wait for every confirm/completion, then send END;
        msgs/s = data messages delivered / (last delivery - first publish)."""
        side = self.sides["qflow" if lib == "qflow" else "rabbitmq"]
        size = SIZES[size_name]
        self.seq += 1
        prefix = f"cmp.{self.seq}.{workload}"
        fanout = None
        arguments = QFLOW_PLAIN if lib == "qflow" else {}
        persistent = workload == "persistent"
        common = {"lib": lib, "port": side.port, "size": size, "timeout": self.args.client_timeout,
                  # no limit, no pacing, no ids: the qflow clients run make bench's loops
                  "plain": workload != "flow", "persistent": persistent}
        prod = {**common, "role": "produce", "window": 1000, "exchange": "", "count": self.args.max_count,
                "duration": self.args.duration, "end": True}
        cons = {**common, "role": "consume", "prefetch": 1000, "ack_every": 500, "ends": 1}
        if workload in ("1p1c", "persistent"):  # persistent: a durable queue, every message persistent
            queues = [f"{prefix}.0"]
            specs = [{**cons, "queue": queues[0]}, {**prod, "routing_key": queues[0]}]
        elif workload == "4p4c":
            queues = [f"{prefix}.{i}" for i in range(4)]
            specs = [{**cons, "queue": q} for q in queues]
            specs += [{**prod, "routing_key": q} for q in queues]
        elif workload == "fanout4":
            queues = [f"{prefix}.{i}" for i in range(4)]
            fanout = f"{prefix}.fan"
            specs = [{**cons, "queue": q} for q in queues]
            specs.append({**prod, "exchange": fanout, "routing_key": ""})
        elif workload == "flow":
            queues = [f"{prefix}.0"]
            arguments = QFLOW_FLOW if lib == "qflow" else RABBIT_FLOW
            specs = [{**cons, "queue": queues[0], "ends": 2, "pause_every": self.args.slow_every,
                      "slow_factor": self.args.slow_factor}]
            specs += [{**prod, "routing_key": queues[0], "tag": t} for t in "ab"]
        else:
            raise ValueError(workload)
        results, broker_cpu, idle_cpu, stats = self._run_on(side, specs, queues, arguments, fanout, persistent)
        producers = [r for r in results if r["role"] == "produce"]
        consumers = [r for r in results if r["role"] == "consume"]
        if any(r["timed_out"] for r in results):
            raise RuntimeError(f"{workload} {size_name} {lib}: a client timed out: {results}")
        acked = sum(r["acked"] for r in producers)
        received = sum(r["received"] for r in consumers)
        expected = acked * (4 if fanout else 1)
        if received != expected:
            raise RuntimeError(f"{workload} {size_name} {lib}: {acked} messages confirmed, {received} delivered "
                               f"(expected {expected}): {results}")
        t0 = min(r["t0"] for r in producers)
        elapsed = max(r["t_last"] for r in consumers) - t0
        return {
            # fanout: messages published (each was delivered four times)
            "msgs_per_s": round(acked / elapsed), "seconds": round(elapsed, 3), "count": acked,
            "broker_cpu_s": round(broker_cpu, 2), "idle_broker_cpu_s": round(idle_cpu, 2), "producer_cpu_s": round(sum(r["cpu"] for r in producers), 2),
            "consumer_cpu_s": round(sum(r["cpu"] for r in consumers), 2),
            "resends": sum(r["resends"] for r in producers), "nacks": sum(r["nacked"] for r in producers),
            **{k: v for k, v in stats.items() if k == "flow_stops"},
            # the slow consumer's share of the run spent resting (3/4 when it keeps to its pace)
            **({"consumer_rested": round(consumers[0]["rested"] / elapsed, 2)} if workload == "flow" else {}),
        }

    def backpressure(self, lib: str) -> dict:
        """Three producers (windows 50/13/149; 1213/797/331 messages) into a
        373-message queue drained at a fixed slow rate."""
        side = self.sides["qflow" if lib == "qflow" else "rabbitmq"]
        self.seq += 1
        q = f"cmp.{self.seq}.backpressure"
        total = sum(BP_COUNTS)
        common = {"lib": lib, "port": side.port, "size": 64, "timeout": self.args.client_timeout, "track": True}
        specs = [{**common, "role": "consume", "queue": q, "count": total, "prefetch": BP_PREFETCH,
                  "ack_every": max(1, BP_PREFETCH // 2),
                  "rate": self.args.bp_rate}]
        specs += [{**common, "role": "produce", "exchange": "", "routing_key": q, "window": w, "count": n, "tag": t,
                   "backoff": self.args.bp_backoff_ms / 1000}
                  for w, n, t in zip(BP_WINDOWS, BP_COUNTS, "abc", strict=True)]
        specs.append({**common, "role": "monitor", "queue": q, "interval": 0.005, "consumer_prefetch": BP_PREFETCH})
        results, broker_cpu, _, stats = self._run_on(side, specs, [q], QFLOW_BP if lib == "qflow" else RABBIT_BP)
        producers = [r for r in results if r["role"] == "produce"]
        (consumer,) = [r for r in results if r["role"] == "consume"]
        (mon,) = [r for r in results if r["role"] == "monitor"]
        t0 = min(r["t0"] for r in producers)
        return {
            "lost": total - consumer["unique"],
            "duplicates": consumer["duplicates"],
            "resends": sum(r["resends"] for r in producers),
            "nacks": sum(r["nacked"] for r in producers),
            "publishes": sum(r["published"] for r in producers),
            # qflow: msgDepth (queued + delivered-unaccepted); RabbitMQ: ready + the consumer's prefetch,
            # the most that can be delivered-unacked (x-max-length counts ready messages only).
            "peak_depth": mon["peak_depth"] + mon["peak_unacked"],
            "peak_unacked_bound": mon["peak_unacked"],
            "wall_s": round(consumer["t_last"] - t0, 3),
            "broker_cpu_s": round(broker_cpu, 3),
            "producer_cpu_s": round(sum(r["cpu"] for r in producers), 3),
            "consumer_cpu_s": round(consumer["cpu"], 3),
            "timed_out": any(r.get("timed_out") for r in results),
            **{k: v for k, v in stats.items() if k == "flow_stops"},
        }


