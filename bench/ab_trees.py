"""The producer's client library, or the broker, of two source trees,
interleaved in one run: is a change a regression, or a gain? (bench/README.md)

    git archive main qflow | tar -x -C /tmp/base && cp qflow/_*.so /tmp/base/qflow/
    .venv/bin/python bench/ab_trees.py --base /tmp/base --rounds 5 [--side broker] [--durable]

Each run is ``make bench``'s 64b workload (a fresh qflowd, one consumer, one
producer calling ``Sender.send`` once per message, capacity 1000, credit 1000),
with one side's qflow imported from ``--base`` (A) or from this tree (B), the
rest from this tree, alternated A B, B A, A B ...; ``--durable`` adds the same on a
durable queue with a durable sender. ``--side producer`` (the default): the
producer's client library differs; reported per variant: msg/s (first send to
last fetch), the producer's own CPU per message (its process time over the
send loop and the final sync), and the median over rounds of the B/A ratios
of runs side by side. ``--side broker``: qflowd differs; also reported, with
``--durable``, each variant's persistent ÷ transient ratio per round. The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import trio

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from run import NO_FLOW, _client, _declare, _expect, spin_loop, start_broker  # noqa: E402

# The producer, run with the qflow of the tree first on sys.path (argv[1]).
PRODUCER = """
import sys, time
sys.path.insert(0, sys.argv[1])
import trio, qflow
port, count, size, durable = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "durable"
assert qflow.__file__.startswith(sys.argv[1] + "/"), qflow.__file__

async def main():
    async with await qflow.connect("127.0.0.1", port) as conn:
        sender = (await conn.session()).sender("bench", capacity=1000, durable=durable)
        body = b"x" * size
        print("READY", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("the parent went away")
        t0, c0 = time.perf_counter(), time.process_time()
        send = sender.send
        for _ in range(count):
            await send(body)
        await sender.sync()
        print(f"RESULT {t0!r} {time.process_time() - c0!r}", flush=True)

trio.run(main)
"""


def one_run(tree: str, count: int, size: int, durable: bool, side: str) -> dict:
    # qflowd runs as ``python -m``, so its sys.path starts with the current directory (main() moved
    # out of any tree) and then PYTHONPATH: the tree asked for.
    d = start_broker(env={"PYTHONPATH": tree if side == "broker" else ROOT})
    try:
        trio.run(_declare, d.port, "bench", NO_FLOW, None, durable)
        consumer = _client("consume", d.port, "bench", count, size)
        producer = subprocess.Popen([sys.executable, "-c", PRODUCER, tree if side == "producer" else ROOT,
                                     str(d.port), str(count), str(size), "durable" if durable else "transient"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs = (consumer, producer)
        try:
            for p in procs:
                _expect(p, "READY")
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            t_last = float(_expect(consumer, "RESULT"))
            t0, cpu = map(float, _expect(producer, "RESULT").split())
            for p in procs:
                p.stdin.close()
                if p.wait(timeout=60):
                    raise SystemExit("a client failed")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return {"msgs_per_s": count / (t_last - t0), "producer_us_per_msg": 1e6 * cpu / count}
    finally:
        d.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="the other tree (its qflow/ with the compiled extensions)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--durable", action="store_true", help="also persistent: a durable queue and sender")
    parser.add_argument("--side", choices=("producer", "broker"), default="producer",
                        help="whose qflow comes from --base: the producer's, or qflowd's")
    args = parser.parse_args()
    base = os.path.abspath(args.base)
    os.chdir(tempfile.gettempdir())  # no qflow/ in qflowd's current directory, which python -m puts first
    kinds = [False, True] if args.durable else [False]
    runs: dict[str, list[dict]] = {}
    spins = [spin_loop()]
    for rnd in range(args.rounds):
        for durable in kinds:
            # A B in even rounds, B A in odd ones: neither variant always runs first
            for name, tree in (("A", base), ("B", ROOT))[::-1 if rnd % 2 else 1]:
                key = f"{name}_{'persistent' if durable else 'transient'}"
                runs.setdefault(key, []).append(one_run(tree, args.count, args.size, durable, args.side))
        spins.append(spin_loop())
    out: dict = {"side": args.side, "count": args.count, "size": args.size, "rounds": args.rounds, "spin_loop_s": [round(s, 3) for s in spins]}
    for durable in kinds:
        kind = "persistent" if durable else "transient"
        a, b = runs[f"A_{kind}"], runs[f"B_{kind}"]
        for field in ("msgs_per_s", "producer_us_per_msg"):
            ratios = [y[field] / x[field] for x, y in zip(a, b, strict=True)]
            out[f"{kind}_{field}_A"] = [round(r[field], 2) for r in a]
            out[f"{kind}_{field}_B"] = [round(r[field], 2) for r in b]
            out[f"{kind}_{field}_B_over_A"] = round(statistics.median(ratios), 3)
            print(f"{kind:>10} {field:>20}: A {statistics.median(r[field] for r in a):>10.2f}   "
                  f"B {statistics.median(r[field] for r in b):>10.2f}   B/A per round "
                  + " ".join(f"{r:.2f}" for r in ratios) + f"   median {statistics.median(ratios):.3f}")
    if args.durable:
        for name in "AB":
            ratios = [p["msgs_per_s"] / t["msgs_per_s"]
                      for p, t in zip(runs[f"{name}_persistent"], runs[f"{name}_transient"], strict=True)]
            out[f"{name}_persistent_over_transient"] = round(statistics.median(ratios), 3)
            print(f"{name}: persistent / transient per round " + " ".join(f"{r:.2f}" for r in ratios)
                  + f"   median {statistics.median(ratios):.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
