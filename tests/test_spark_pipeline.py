"""examples/spark_pipeline.py, shortened by its options, as a user runs it:
its own qflowd, a Spark driver process, a fast and a slow results consumer,
and the exactly-once check that kills the driver (SIGKILL) mid-run and
restarts the query from its checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Spark is slow to start and does not depend on the accounting implementation.
pytestmark = pytest.mark.native_only

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "spark_pipeline.py")


def test_pipeline_shows_back_pressure_and_counts_every_order_once_across_a_driver_kill() -> None:
    """Issue 15: "A fast results consumer gives the same peak depth and
    flow-stop count as a slow one ... Its 'exactly-once check' runs without
    any failure and cannot resume after a crash." The slow consumer's run
    must hold the producer longer and stop the flows more often than the
    fast one's (same producer, same Spark, no per-trigger cap); depths stay
    within stop + capacities; and every order event's message id is counted
    in exactly one result, in each run and across the killed driver."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--orders", "1000", "--rate", "100", "--products", "4", "--orders-per-minute", "50",
         "--orders-flow", "400:300", "--slow-rate", "2", "--every", "10", "--timeout", "600"],
        capture_output=True, text=True, timeout=1500, env=env)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-5000:]
    runs = {run["name"]: run for run in json.loads(out.strip().splitlines()[-1])["runs"]}
    fast, slow, crash = runs["fast"], runs["slow"], runs["crash"]
    assert "fast consumer" in out and "slow consumer" in out and "exactly-once check" in out, out
    for run in (fast, slow, crash):
        assert run["exactly_once"] and not run["problem"], run
        assert run["orders_peak"] <= run["orders_bound"] and run["revenue_peak"] <= run["revenue_bound"], run
    # Back-pressure, not start-up or caps: the slow consumer's run differs. It reaches the producer as held
    # transfers once the orders queue stops; whether its 50-transfer window fills (time spent in send) depends
    # on how fast Spark then drains the burst, which a loaded machine changes (held 0.0 with a peak of 430 over
    # a stop of 400 was seen under two suites at once). So: held longer, or the source queue stopped more often.
    assert slow["held"] > fast["held"] + 1.0 or slow["orders_stops"] > fast["orders_stops"], (fast, slow)
    assert slow["revenue_stops"] > fast["revenue_stops"], (fast, slow)
    assert slow["orders_stops"] + slow["revenue_stops"] > fast["orders_stops"] + fast["revenue_stops"], (fast, slow)
    # The crash check killed the driver mid-run, and the restarted query's
    # replay was seen (and dropped) as duplicates by message id.
    assert crash["killed_at"] is not None and 0 < crash["killed_at"] < 1000, crash
    assert "killing the Spark driver" in out and "restarted the query from its checkpoint" in out, out
