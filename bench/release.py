"""Release latency: 10,000 held transfers released at once.

Measured inside one broker process, with no sockets, from the moment the
triggering ``message.accept`` is handed to the broker until every completion
report has been written to the producers' connection buffers: the path the
accounting's batch call owns. Both accounting implementations, interleaved.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from qflow import protocol as P
from qflow.broker import Broker
from qflow.broker.accounting import PyAccounting, native_available
from qflow.broker.commands import execute

BIG = 1_000_001  # one message over the byte stop threshold turns the flow on


def one_release(accounting: Any, held: int, sessions: int) -> float:
    broker = Broker(accounting=accounting)
    q, _ = broker.declare_queue("q", arguments={"qpid.flow_stop_size": 1_000_000,
                                                "qpid.flow_resume_size": 100_000, "qpid.max_size": 0})
    producers = [broker.open_session(0, f"p{i}") for i in range(sessions)]
    consumer = broker.open_session(0, "c")
    broker.transfer(producers[0], producers[0].commands.receive(), "", "q", None, b"x" * BIG)
    for i in range(held):
        p = producers[i % sessions]
        broker.transfer(p, p.commands.receive(), "", "q", None, b"y")
    broker.flush()
    assert broker.acct.stats(q.slot)[4] == held + 1, "not everything is held"
    execute(broker, consumer, consumer.commands.receive(), P.SUBSCRIBE, ["q", "d", P.ACCEPT_EXPLICIT, 0, 0])
    execute(broker, consumer, consumer.commands.receive(), P.FLOW, ["d", 1, -1])
    broker.flush()  # delivers the big message only
    for p in producers:
        p.out.take()
    gc.collect()  # the set-up's garbage is not the release's cost
    t0 = time.perf_counter()
    execute(broker, consumer, consumer.commands.receive(), P.ACCEPT, [[0, 0]])
    broker.flush()
    elapsed = time.perf_counter() - t0
    assert all(p.commands.floor == p.commands.next_id for p in producers), "a transfer is still incomplete"
    assert broker.acct.stats(q.slot)[2] is False
    return elapsed


def measure(rounds: int = 30, held: int = 10_000, sessions: int = 10) -> dict:
    kinds = {"python": PyAccounting}
    if native_available():
        from qflow.broker._native_accounting import NativeAccounting

        kinds["native"] = NativeAccounting
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for name, cls in kinds.items():
            times[name].append(one_release(cls(), held, sessions))
    out = {}
    for name, ts in times.items():
        ts.sort()
        out[name] = {"median_ms": round(statistics.median(ts) * 1e3, 3),
                     "p99_ms": round(ts[min(len(ts) - 1, int(len(ts) * 0.99))] * 1e3, 3)}
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(measure()))
