"""bench/ab_trees.py, tiny: it runs both trees' producers, or both trees'
brokers, transient and persistent, and reports the B/A ratios (here the tree
against itself), so the A/B tool does not rot between uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("side", ["producer", "broker"])
def test_ab_trees_runs_both_trees_and_reports_ratios(side: str) -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_trees.py"), "--base", ROOT,
                          "--rounds", "1", "--count", "300", "--durable", "--side", side],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out.splitlines()[-1])
    for kind in ("transient", "persistent"):
        for field in ("msgs_per_s", "producer_us_per_msg"):
            assert result[f"{kind}_{field}_B_over_A"] > 0
            assert len(result[f"{kind}_{field}_A"]) == len(result[f"{kind}_{field}_B"]) == 1
    assert result["side"] == side and result["A_persistent_over_transient"] > 0


def test_sender_path_times_both_senders() -> None:
    """bench/sender_path.py, tiny (this tree against itself)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sender_path.py"), "--base", ROOT,
                          "--samples", "4", "--sends", "300"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    result = json.loads(out.splitlines()[-1])
    for kind in ("plain", "durable"):
        assert result[kind]["A_ns_per_send"] > 0 and result[kind]["B_over_A"] > 0
