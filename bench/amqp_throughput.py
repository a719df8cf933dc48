"""qflowd beside qpidd over AMQP 1.0, the same clients on both: ``make bench-amqp``.

    .venv/bin/python bench/amqp_throughput.py [--rounds 3] [--count 200000]
    .venv/bin/python bench/amqp_throughput.py --smoke      # seconds, qflowd only, no qpidd

One qflowd (as ``make bench`` starts it) and one qpidd with its AMQP 1.0
module (built by ../shared/anchors/build-qpidd.sh; ``--load-module amqp.so
--auth no --no-data-dir``, its queues made on demand by ``--queue-patterns``)
run for the whole benchmark. Each run is one receiver and one sender process,
a fresh queue, a fixed count of messages, on one broker; for every round,
size and client the two brokers run back to back, the first alternating by
round. Clients:

* ``qpid``: Qpid's own qpid-receive and qpid-send over 1.0
  (``--connection-options "{protocol: amqp1.0}"``), capacity 1000 on both
  (the sender's unsettled window, the receiver's prefetch), the address a
  plain queue name. The receiver is subscribed before the sender starts (its
  ``--ready-address`` message). msg/s = count / (sender started -> both exited).
* ``proton``: a python-qpid-proton Container receiver (prefetch 1000,
  auto-accept) and a Container sender that sends whenever it has credit,
  unsettled. msg/s = count / (the sender's first send -> the receiver's last
  message), wall clocks of the same host.

Each run also reads the broker's CPU (user + system of its process, all
threads, from /proc/PID/stat) before the sender starts and after both
clients exit: ``broker_cpu_us`` is that per message. qflowd's queues are
declared with no limit and no flow control (as ``make bench``'s); qpidd's
are its defaults (no flow control is reached: the receiver keeps up).

``--tools-cap`` adds what the tools alone can do: qpid-send into a broker
with nobody receiving (qflowd and qpidd), and qpid-receive draining a queue
filled beforehand, so a ratio capped by the clients shows as such.

Figures drift on these shared 2-core machines: only ratios from one run
mean anything (the spin-loop probe before each round shows the drift). The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(1, ROOT)

QPID_BUILD = os.path.expanduser("~/.cache/qflow-anchors/qpid-cpp")
AMQP10 = ["--connection-options", "{protocol: amqp1.0}"]
QUEUE_PREFIX = "amqpbench"
CLIENT_TIMEOUT = 300
SIZES = {"64b": 64, "1k": 1024}

# -- the proton clients (this file, run as ``--client proton-send|proton-receive``) ------------------------------


def proton_client(argv: list[str]) -> None:
    """One proton Container client: ``ROLE URL QUEUE COUNT SIZE``. The receiver
    prints READY once its link is attached and ``RESULT t`` (time.time() of its
    last message); the sender prints ``RESULT t`` (time.time() of its first send)
    once every delivery is settled."""
    from proton import Message
    from proton.handlers import MessagingHandler
    from proton.reactor import Container

    role, url, queue, count, size = argv[0], argv[1], argv[2], int(argv[3]), int(argv[4])

    class Receive(MessagingHandler):
        def __init__(self) -> None:
            super().__init__(prefetch=1000, auto_accept=True)
            self.got = 0

        def on_start(self, event) -> None:
            event.container.create_receiver(event.container.connect(url), queue)

        def on_link_opened(self, event) -> None:
            print("READY", flush=True)

        def on_message(self, event) -> None:
            self.got += 1
            if self.got == count:
                print(f"RESULT {time.time()!r}", flush=True)
                event.connection.close()

    class Send(MessagingHandler):
        def __init__(self) -> None:
            super().__init__()
            self.sent = self.settled = 0
            self.t0 = 0.0
            self.message = Message(body=b"x" * size)

        def on_start(self, event) -> None:
            event.container.create_sender(event.container.connect(url), queue)

        def on_sendable(self, event) -> None:
            sender = event.sender
            if not self.t0:
                self.t0 = time.time()
            while sender.credit and self.sent < count:
                sender.send(self.message)
                self.sent += 1

        def on_settled(self, event) -> None:
            self.settled += 1
            if self.settled == count:
                print(f"RESULT {self.t0!r}", flush=True)
                event.connection.close()

    Container(Receive() if role == "proton-receive" else Send()).run()


# -- the brokers ------------------------------------------------------------------------------------------------


class Broker:
    """One broker for the whole benchmark: ``pid``, ``url``, ``prepare(queue)``, ``stop()``."""

    name = ""
    pid = 0
    url = ""

    def prepare(self, queue: str) -> None:
        """Make ``queue`` exist, if the broker does not on demand."""

    def stop(self) -> None:
        raise NotImplementedError


class QflowdBroker(Broker):
    name = "qflowd"

    def __init__(self, tree: str | None = None) -> None:
        from run import start_broker

        if tree is not None:  # another source tree's qflowd (--base), for a before/after in the same run
            self.name = "qflowd_base"
        self.daemon = start_broker(env={"PYTHONPATH": tree or ROOT})
        self.pid = self.daemon.proc.pid
        self.url = f"127.0.0.1:{self.daemon.port}"

    def prepare(self, queue: str) -> None:
        import trio
        from run import NO_FLOW, _declare

        trio.run(_declare, self.daemon.port, queue, NO_FLOW)

    def stop(self) -> None:
        self.daemon.stop()


class QpiddBroker(Broker):
    name = "qpidd"

    def __init__(self, tools: dict[str, str]) -> None:
        from compare.qpidd_latency import QpiddSide

        self.side = QpiddSide(tools, lambda line: None, ["--queue-patterns", f"{QUEUE_PREFIX}.*"])
        self.pid = self.side.pid
        self.url = f"127.0.0.1:{self.side.port}"

    def stop(self) -> None:
        self.side.stop()


# -- one run ------------------------------------------------------------------------------------------------------


def _finish(proc: subprocess.Popen, what: str, deadline: float) -> str:
    try:
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise RuntimeError(f"{what} did not finish in time") from None
    if proc.returncode:
        raise RuntimeError(f"{what} exited {proc.returncode}: {(out + err)[-600:]!r}")
    return out


def _cpu(pid: int) -> float:
    from run import cpu_seconds

    return cpu_seconds(pid)


def qpid_run(tools: dict[str, str], broker: Broker, queue: str, count: int, size: int, capacity: int) -> dict:
    """qpid-receive subscribed, then qpid-send; msg/s and the broker's CPU per message."""
    ready = f"{queue}.ready"
    broker.prepare(queue)
    broker.prepare(ready)
    deadline = time.monotonic() + CLIENT_TIMEOUT
    receiver = subprocess.Popen([tools["receive"], "-b", broker.url, *AMQP10, "-a", queue, "--messages", str(count),
                                 "--capacity", str(capacity), "--timeout", "60", "--print-content", "no",
                                 "--report-total", "--ready-address", ready],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _finish(subprocess.Popen([tools["receive"], "-b", broker.url, *AMQP10, "-a", ready, "--messages", "1",
                                  "--timeout", "30", "--print-content", "no"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
                "qpid-receive (ready)", deadline)
        cpu0, t0 = _cpu(broker.pid), time.perf_counter()
        sender = subprocess.Popen([tools["send"], "-b", broker.url, *AMQP10, "-a", queue, "--messages", str(count),
                                   "--capacity", str(capacity), "--content-size", str(size), "--report-total"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _finish(receiver, "qpid-receive", deadline)
        _finish(sender, "qpid-send", deadline)
        elapsed, cpu = time.perf_counter() - t0, _cpu(broker.pid) - cpu0
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait()
    return {"msgs_per_s": round(count / elapsed), "broker_cpu_us": round(1e6 * cpu / count, 2)}


def proton_run(broker: Broker, queue: str, count: int, size: int) -> dict:
    broker.prepare(queue)
    deadline = time.monotonic() + CLIENT_TIMEOUT
    cmd = [sys.executable, os.path.abspath(__file__), "--client"]
    receiver = subprocess.Popen([*cmd, "proton-receive", broker.url, queue, str(count), str(size)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sender = None
    try:
        line = receiver.stdout.readline()
        if not line.startswith("READY"):
            raise RuntimeError(f"the proton receiver did not attach: {line!r} {receiver.communicate()[1][-600:]!r}")
        cpu0 = _cpu(broker.pid)
        sender = subprocess.Popen([*cmd, "proton-send", broker.url, queue, str(count), str(size)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t_last = float(_finish(receiver, "the proton receiver", deadline).split()[-1])
        t_first = float(_finish(sender, "the proton sender", deadline).split()[-1])
        cpu = _cpu(broker.pid) - cpu0
    finally:
        for p in (receiver, sender):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    return {"msgs_per_s": round(count / (t_last - t_first)), "broker_cpu_us": round(1e6 * cpu / count, 2)}


def tools_cap(tools: dict[str, str], broker: Broker, queue: str, count: int, size: int, capacity: int) -> dict:
    """qpid-send alone into ``queue`` (nobody receives), then qpid-receive alone draining it."""
    broker.prepare(queue)
    deadline = time.monotonic() + CLIENT_TIMEOUT
    out = {}
    for role, cmd in (("send", [tools["send"], "-b", broker.url, *AMQP10, "-a", queue, "--messages", str(count),
                                "--capacity", str(capacity), "--content-size", str(size)]),
                      ("receive", [tools["receive"], "-b", broker.url, *AMQP10, "-a", queue, "--messages",
                                   str(count), "--capacity", str(capacity), "--timeout", "30",
                                   "--print-content", "no"])):
        cpu0, t0 = _cpu(broker.pid), time.perf_counter()
        _finish(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), f"qpid-{role}",
                deadline)
        elapsed, cpu = time.perf_counter() - t0, _cpu(broker.pid) - cpu0
        out[f"{role}_msgs_per_s"] = round(count / elapsed)
        out[f"{role}_broker_cpu_us"] = round(1e6 * cpu / count, 2)
    return out


# -- the whole run ------------------------------------------------------------------------------------------------


def qpid_tools(build: str) -> dict[str, str] | None:
    from compare.qpidd_latency import qpid_tools as find

    return find(build)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true",
                        help="seconds: qflowd only, the proton pair, a few thousand messages (no qpidd)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--count", type=int, default=200_000, help="messages per qpid-send/qpid-receive run")
    parser.add_argument("--proton-count", type=int, default=50_000, help="messages per proton run")
    parser.add_argument("--sizes", default="64b,1k", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--clients", default="qpid,proton", help="comma-separated: qpid, proton")
    parser.add_argument("--capacity", type=int, default=1000)
    parser.add_argument("--tools-cap", action="store_true",
                        help="also qpid-send alone and qpid-receive alone against each broker, each round")
    parser.add_argument("--base", help="also a qflowd of this source tree (its qflow/ with the compiled "
                        "extensions, as bench/ab_trees.py takes): before/after in the same run")
    parser.add_argument("--qpid-build", default=os.environ.get("QPID_BUILD", QPID_BUILD),
                        help="where ../shared/anchors/build-qpidd.sh built qpidd and the tools")
    args = parser.parse_args()
    from run import spin_loop

    sizes = [s for s in args.sizes.split(",") if s]
    clients = [c for c in args.clients.split(",") if c]
    for s in sizes:
        if s not in SIZES:
            raise SystemExit(f"unknown size {s!r}: choose from {', '.join(SIZES)}")
    for c in clients:
        if c not in ("qpid", "proton"):
            raise SystemExit(f"unknown client {c!r}: choose from qpid, proton")
    if args.smoke:
        args.rounds, args.count, args.proton_count, clients = 1, 2000, 2000, ["proton"]
    tools = None
    if not args.smoke:
        tools = qpid_tools(args.qpid_build)
        if tools is None:
            raise SystemExit(f"no qpidd build in {args.qpid_build}: run ../shared/anchors/build-qpidd.sh first")
    os.chdir(tempfile.gettempdir())  # no qflow/ in qflowd's current directory, which python -m puts first
    brokers: list[Broker] = []
    try:
        brokers.append(QflowdBroker())
        if args.base:
            brokers.append(QflowdBroker(os.path.abspath(args.base)))
        if tools is not None:
            brokers.append(QpiddBroker(tools))
        runs: dict[str, list[dict]] = {}
        spins = []
        n = 0
        for rnd in range(args.rounds):
            spins.append(spin_loop())
            order = brokers if rnd % 2 == 0 else brokers[::-1]
            for size_name in sizes:
                size = SIZES[size_name]
                for client in clients:
                    for broker in order:
                        n += 1
                        queue = f"{QUEUE_PREFIX}.{os.getpid()}.{n}"
                        if client == "qpid":
                            r = qpid_run(tools, broker, queue, args.count, size, args.capacity)
                        else:
                            r = proton_run(broker, queue, args.proton_count, size)
                        runs.setdefault(f"{client}_{size_name}_{broker.name}", []).append(r)
                        print(f"round {rnd + 1} {client:>6} {size_name:>3} {broker.name:>6}: {r['msgs_per_s']:>7} "
                              f"msg/s, broker {r['broker_cpu_us']:>6} us/msg", flush=True)
                    if args.tools_cap and client == "qpid":
                        for broker in order:
                            n += 1
                            r = tools_cap(tools, broker, f"{QUEUE_PREFIX}.{os.getpid()}.{n}", args.count, size,
                                          args.capacity)
                            runs.setdefault(f"cap_{size_name}_{broker.name}", []).append(r)
                            print(f"round {rnd + 1}  alone {size_name:>3} {broker.name:>6}: qpid-send alone "
                                  f"{r['send_msgs_per_s']} msg/s (broker {r['send_broker_cpu_us']} us/msg), "
                                  f"qpid-receive alone {r['receive_msgs_per_s']} msg/s (broker "
                                  f"{r['receive_broker_cpu_us']} us/msg)", flush=True)
        spins.append(spin_loop())
    finally:
        for b in brokers:
            b.stop()
    out: dict = {"count": args.count, "proton_count": args.proton_count, "rounds": args.rounds,
                 "capacity": args.capacity, "spin_loop_s": [round(s, 3) for s in spins]}
    print(f"median of {args.rounds} round(s); qflowd/qpidd: median of the rounds' pairs")
    for client in clients:
        for size_name in sizes:
            meds = {}
            for b in brokers:
                rs = runs[f"{client}_{size_name}_{b.name}"]
                meds[b.name] = (statistics.median(r["msgs_per_s"] for r in rs),
                                statistics.median(r["broker_cpu_us"] for r in rs))
                out[f"{client}_{size_name}_msgs_per_s_{b.name}"] = [r["msgs_per_s"] for r in rs]
                out[f"{client}_{size_name}_broker_cpu_us_{b.name}"] = [r["broker_cpu_us"] for r in rs]
                key = "qpid_tools" if client == "qpid" else client
                out[f"broker_cpu_us_{size_name}_{b.name}" if client == "qpid" else
                    f"{key}_broker_cpu_us_{size_name}_{b.name}"] = meds[b.name][1]
            line = "  ".join(f"{name} {m[0]:>7.0f} msg/s {m[1]:>6.2f} us/msg" for name, m in meds.items())
            key = "qpid_tools" if client == "qpid" else client
            for other in brokers[1:]:
                a, b = runs[f"{client}_{size_name}_qflowd"], runs[f"{client}_{size_name}_{other.name}"]
                ratio = statistics.median(x["msgs_per_s"] / y["msgs_per_s"] for x, y in zip(a, b, strict=True))
                cpu = statistics.median(x["broker_cpu_us"] / y["broker_cpu_us"] for x, y in zip(a, b, strict=True))
                out[f"{key}_{size_name}_qflowd_over_{other.name}"] = round(ratio, 3)
                out[f"{key}_{size_name}_broker_cpu_qflowd_over_{other.name}"] = round(cpu, 3)
                line += f"  qflowd/{other.name} {ratio:.2f} (CPU {cpu:.2f})"
            print(f"{client:>6} {size_name:>3}: {line}")
        if args.tools_cap and client == "qpid":
            for size_name in sizes:
                for b in brokers:
                    rs = runs[f"cap_{size_name}_{b.name}"]
                    for field in ("send_msgs_per_s", "send_broker_cpu_us", "receive_msgs_per_s",
                                  "receive_broker_cpu_us"):
                        out[f"alone_{size_name}_{b.name}_{field}"] = statistics.median(r[field] for r in rs)
    print(f"spin loop (before each round, after): {' '.join(f'{s:.3f}' for s in spins)} s")
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        proton_client(sys.argv[2:])
    else:
        main()
