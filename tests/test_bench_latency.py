"""The latency benchmarks' arithmetic (bench/latency.py, bench/compare/qpidd_latency.py):
nearest-rank percentiles, the per-hop breakdown from the tracing shim's stamps, and the
parsing of qpid-receive's and qflow-receive's --report-total. The measurements themselves
run in `make bench` (its smoke run in `make test`)."""

from __future__ import annotations

import array
import importlib.util
import json
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


def _load(name: str, path: str) -> object:
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_path = list(sys.path)
latency = _load("bench_latency", "latency.py")  # it puts bench/ on sys.path, for bench/run.py
sys.path.insert(0, BENCH)
from compare import qpidd_latency  # noqa: E402 - bench/ is not a package

sys.path[:] = _path


def test_percentiles_nearest_rank() -> None:
    values = array.array("q", [(i + 1) * 1_000_000 for i in range(1000)][::-1])  # 1..1000 ms, any order
    assert latency._percentiles(values) == {"p50": 500.0, "p99": 990.0, "p999": 999.0, "max": 1000.0, "n": 1000}


def test_breakdown_splits_each_message_at_its_stamps(tmp_path) -> None:
    # Message 0: send call 0, written 1, broker read 3, broker wrote 6, consumer read 10, fetched 15 (us).
    # Message 10: every hop 1 us, but its tag was not found in the broker's read: left out.
    us = 1000
    files = {"producer": {"sent": [[0, 1 * us], [10, 101 * us]], "received": []},
             "broker": {"received": [[0, 3 * us]], "sent": [[0, 6 * us], [10, 103 * us]]},
             "consumer": {"received": [[0, 10 * us], [10, 104 * us]], "sent": []}}
    for role, stamps in files.items():
        (tmp_path / f"{role}.json").write_text(json.dumps(stamps))
    (tmp_path / "consumer_fetch.json").write_text(json.dumps([[0, 0, 0, 15 * us], [10, 0, 100 * us, 105 * us]]))
    b = latency.breakdown(str(tmp_path))
    assert b["traced"] == 1 and b["end_to_end_p50_ms"] == 0.015
    assert [h["p50_ms"] for h in b["hops"].values()] == [0.001, 0.002, 0.003, 0.004, 0.005]
    assert list(b["hops"]) == list(latency.HOPS)


def test_breakdown_without_a_whole_message_says_so(tmp_path) -> None:
    for role in ("producer", "broker", "consumer"):
        (tmp_path / f"{role}.json").write_text(json.dumps({"sent": [], "received": []}))
    (tmp_path / "consumer_fetch.json").write_text(json.dumps([[0, 0, 0, 5]]))
    with pytest.raises(SystemExit, match="no traced message was seen at every hop"):
        latency.breakdown(str(tmp_path))


def test_report_total_parsed_from_either_receiver() -> None:
    qpid = "tp(m/s)\tl-min\tl-max\tl-avg\n10000\t0.03\t18.47\t0.20\n"
    assert qpidd_latency._totals(qpid) == {"tp(m/s)": 10000.0, "l-min": 0.03, "l-max": 18.47, "l-avg": 0.2}
    assert qpidd_latency._totals("tp(m/s)\n9537\n") == {"tp(m/s)": 9537.0}
    with pytest.raises(RuntimeError, match="no --report-total"):
        qpidd_latency._totals("qflow-receive: cannot connect\n")
