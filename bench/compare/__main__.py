"""The entry of ``bench/compare`` (``make bench-compare``): ``python bench/compare
[options]`` runs the comparison; ``python bench/compare --client SPEC_JSON``
is one client process, which the comparison starts for every producer,
consumer and monitor (see ``clients``).

It is run as a folder, not with ``-m``: bench/ is not a package, so this file
puts bench/ on sys.path and imports its siblings as the package ``compare``
(and ``run``, the probe that ``make bench`` uses too).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Python put this folder first on sys.path: its modules are only importable as
# the package's (compare.clients ...), or a module would load twice.
sys.path[0] = BENCH


def main() -> None:
    from run import rss_peak_bytes, spin_loop  # bench/run.py: the same probe as `make bench`

    from compare import __doc__ as doc
    from compare.brokers import QflowSide, RabbitSide, ensure_rabbitmq
    from compare.qpidd_latency import QPID_BUILD, QpiddSide, latency_table, qpid_tools, run_latency, summary
    from compare.qpidd_latency import RATES as LATENCY_RATES
    from compare.report import report
    from compare.workloads import RABBIT_LIBS, Bench

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a minute or two: fewer messages, one round")
    parser.add_argument("--rounds", type=int, default=0, help="A B rounds per workload (default 2, quick 1)")
    parser.add_argument("--duration", type=float, default=0,
                        help="seconds each producer publishes in a throughput run (default 2, quick 0.75)")
    parser.add_argument("--max-count", type=int, default=2_000_000,
                        help="at most this many messages per producer and run (bounds memory)")
    parser.add_argument("--clients", default=",".join(RABBIT_LIBS),
                        help="RabbitMQ clients to measure on the one-producer/one-consumer workload; the fastest "
                             "is used for the others")
    parser.add_argument("--close", type=float, default=0.25,
                        help="clients within this fraction of the fastest on 1p1c also run the other workloads")
    parser.add_argument("--workloads", default="1p1c,persistent,4p4c,fanout4,flow,backpressure,latency",
                        help="'latency': qflowd beside qpidd (not RabbitMQ), each with its own command-line tools; "
                             "alone, RabbitMQ is not started")
    parser.add_argument("--qpid-build", default=os.environ.get("QPID_BUILD", QPID_BUILD),
                        help="where ../shared/anchors/build-qpidd.sh built qpidd, qpid-send and qpid-receive")
    parser.add_argument("--latency-rates", default=",".join(map(str, LATENCY_RATES)), help="msg/s, comma-separated")
    parser.add_argument("--latency-duration", type=float, default=0,
                        help="seconds each latency run sends for (default 10, quick 2)")
    parser.add_argument("--slow-every", type=int, default=100, help="flow workload: after this many messages the "
                        "consumer rests ...")
    parser.add_argument("--slow-factor", type=float, default=3.0, help="... this many times as long as they took "
                        "(3: the consumer runs at a quarter of its own speed)")
    parser.add_argument("--bp-rate", type=float, default=1000, help="back-pressure consumer: messages per second")
    parser.add_argument("--bp-backoff-ms", type=float, default=10, help="RabbitMQ producers' pause after a nack")
    parser.add_argument("--client-timeout", type=float, default=120, help="seconds any one client may run")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.duration = args.duration or (0.75 if args.quick else 2.0)
    args.latency_duration = args.latency_duration or (2.0 if args.quick else 10.0)
    workloads = args.workloads.split(",")
    libs = [c for c in args.clients.split(",") if c]
    for c in libs:
        if c not in RABBIT_LIBS:
            raise SystemExit(f"unknown client {c!r}: choose from {', '.join(RABBIT_LIBS)}")
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    tools = qpid_tools(args.qpid_build) if "latency" in workloads else None
    if "latency" in workloads and tools is None:
        log(f"latency beside qpidd: skipped, no qpidd build in {args.qpid_build} "
            "(../shared/anchors/build-qpidd.sh makes one)")
    if workloads == ["latency"]:
        if tools is None:
            raise SystemExit(f"no qpidd build in {args.qpid_build}: run ../shared/anchors/build-qpidd.sh")
        main_latency(args, tools, log)
        return

    available = []
    for c in libs:
        try:
            __import__({"py-amqp": "amqp", "pika": "pika", "aio-pika": "aio_pika"}[c])
            available.append(c)
        except ImportError:
            log(f"client {c} is not installed: skipped (pip install pika aio-pika amqp)")
    if not available:
        raise SystemExit("no RabbitMQ client library installed: pip install pika aio-pika amqp")
    try:
        import amqp  # noqa: F401  (the orchestrator administers RabbitMQ with py-amqp)
    except ImportError:
        raise SystemExit("py-amqp is needed to administer RabbitMQ: pip install amqp") from None

    ensure_rabbitmq(log)
    stop_requested = []

    def on_term(signum, frame):  # turn SIGTERM into an exception so the finally blocks stop the brokers
        stop_requested.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    spin_before = spin_loop()
    qside = rside = pside = bench = latency = version = None
    rss = {}
    try:
        rside = RabbitSide(log)
        version = rside.version
        qside = QflowSide()
        log(f"qflowd ready on 127.0.0.1:{qside.port} (pid {qside.pid})")
        bench = Bench(args, qside, rside, log, spin_loop)
        bench.run_throughput([w for w in workloads if w != "latency"], available)
        if "backpressure" in workloads:
            bench.run_backpressure(available)
        rss = {"qflow": rss_peak_bytes(qside.pid), "rabbitmq": rss_peak_bytes(rside.beam_pid())}
        if tools is not None:
            rside.stop()  # idle beside the latency runs otherwise
            rside = None
            pside = QpiddSide(tools, log)
            latency = run_latency(args, qside, pside, log, spin_loop)
            rss["qpidd"] = rss_peak_bytes(pside.pid)
    finally:
        for side in (qside, rside, pside):
            if side is not None:
                side.stop()
        log("brokers stopped")
    spin_after = spin_loop()
    if latency is not None:
        print(latency_table(latency, args))
    report(args, bench, rss, version, spin_before, spin_after,
           None if latency is None else {"latency_vs_qpidd": summary(latency),
                                         "latency_failures": latency["failures"]})


def main_latency(args, tools: dict, log) -> None:
    """The latency workload alone: qflowd and qpidd, no RabbitMQ."""
    import json

    from run import spin_loop

    from compare.brokers import QflowSide
    from compare.qpidd_latency import QpiddSide, latency_table, run_latency, summary

    spin_before = spin_loop()
    qside = pside = None
    try:
        qside = QflowSide()
        log(f"qflowd ready on 127.0.0.1:{qside.port} (pid {qside.pid})")
        pside = QpiddSide(tools, log)
        latency = run_latency(args, qside, pside, log, spin_loop)
    finally:
        for side in (qside, pside):
            if side is not None:
                side.stop()
        log("brokers stopped")
    print(latency_table(latency, args))
    print(json.dumps({"latency_vs_qpidd": summary(latency), "latency_failures": latency["failures"],
                      "latency_duration_s": args.latency_duration, "rounds": args.rounds,
                      "spin_loop_s": [round(spin_before, 3), round(spin_loop(), 3)],
                      "spin_loop_s_rounds": [round(s, 3) for s in latency["spins"]]}))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        from compare.clients import run_client

        run_client(sys.argv[2])
    else:
        main()
