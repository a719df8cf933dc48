"""Benchmark ``apply`` of PyAccounting against NativeAccounting; prints JSON.

Three measurements, each per message (or per released transfer):

* ``flow_off``: 100,000 single-destination transfers (OP_TRANSFER1) to a queue
  without flow control: every transfer completes inside the call.
* ``flow_on``: the same log on a queue whose flow is ON: every transfer is
  held, so the call also returns 100,000 holds.
* ``release``: one dequeue that turns a queue's flow OFF and releases its
  10,000 held transfers.

The machine's speed drifts, so both implementations are measured in the same
run, interleaved (A B A B ...), and the medians compared. As with timeit, the
garbage collector is off while a call is timed.

Usage: python bench/bench_accounting.py [--rounds N]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from array import array

from qflow.broker._native_accounting import NativeAccounting
from qflow.broker.accounting import OP_DEQUEUE, OP_ENQUEUE, OP_TRANSFER1, PyAccounting

MESSAGES = 100_000
HELD = 10_000
BODY = 100  # bytes per message
SESSION = 1
BIG = 10**9  # one message that alone holds the flow ON
LIMIT = 10**8  # stop and resume size: far above the transfers' bytes


def transfers(n: int, queue: int) -> array:
    log = array("q")
    for command_id in range(n):
        log.extend((OP_TRANSFER1, SESSION, command_id, queue, BODY))
    return log


def timed(call) -> tuple[int, object]:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter_ns()
        result = call()
        elapsed = time.perf_counter_ns() - start
    finally:
        gc.enable()
    return elapsed, result


def stopped_queue(acc) -> int:
    """A queue with flow ON (by bytes) and nothing held yet."""
    queue = acc.add_queue()
    acc.set_thresholds(queue, 0, 0, LIMIT, LIMIT)
    acc.apply(array("q", [OP_ENQUEUE, queue, BIG, 0, 0]))
    assert acc.stats(queue)[2]
    return queue


def flow_off(cls, log: array) -> float:
    acc = cls()
    acc.add_queue()
    elapsed, (completions, holds, _) = timed(lambda: acc.apply(log))
    assert completions == [(SESSION, 0, MESSAGES - 1)] and not holds
    return elapsed / MESSAGES


def flow_on(cls, log: array) -> float:
    acc = cls()
    stopped_queue(acc)
    elapsed, (completions, holds, _) = timed(lambda: acc.apply(log))
    assert not completions and len(holds) == MESSAGES
    return elapsed / MESSAGES


def release(cls, log: array) -> float:
    acc = cls()
    queue = stopped_queue(acc)
    acc.apply(log)
    dequeue = array("q", [OP_DEQUEUE, queue, BIG, -1, 0])
    elapsed, (completions, _, transitions) = timed(lambda: acc.apply(dequeue))
    assert completions == [(SESSION, 0, HELD - 1)] and transitions == [(queue, False, HELD, HELD * BODY)]
    return elapsed / HELD


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    # Every run uses a fresh accounting, whose first queue is slot 0.
    many = transfers(MESSAGES, 0)
    logs = {"flow_off": many, "flow_on": many, "release": transfers(HELD, 0)}
    cases = {"flow_off": flow_off, "flow_on": flow_on, "release": release}
    impls = {"python": PyAccounting, "native": NativeAccounting}
    samples = {name: {case: [] for case in cases} for name in impls}
    for _ in range(args.rounds):
        for case, run in cases.items():
            for name, cls in impls.items():
                samples[name][case].append(run(cls, logs[case]))

    units = {"flow_off": "ns_per_message", "flow_on": "ns_per_message", "release": "ns_per_released_transfer"}
    medians = {
        name: {case: statistics.median(s) for case, s in by_case.items()} for name, by_case in samples.items()
    }
    report = {
        "messages": MESSAGES,
        "held_released": HELD,
        "rounds": args.rounds,
        "unit": units,
        **{name: {case: round(v, 1) for case, v in m.items()} for name, m in medians.items()},
        "native_over_python": {
            case: round(medians["native"][case] / medians["python"][case], 4) for case in cases
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
