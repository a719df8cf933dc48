"""bench/ab_sender.py, tiny: it runs both trees' producers against a real
qflowd, transient and persistent, and reports the B/A ratios (here the tree
against itself), so the A/B tool does not rot between uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ab_sender_runs_both_trees_and_reports_ratios() -> None:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ab_sender.py"), "--base", ROOT,
                          "--rounds", "1", "--count", "300", "--durable"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    result = json.loads(out.splitlines()[-1])
    for kind in ("transient", "persistent"):
        for field in ("msgs_per_s", "producer_us_per_msg"):
            assert result[f"{kind}_{field}_B_over_A"] > 0
            assert len(result[f"{kind}_{field}_A"]) == len(result[f"{kind}_{field}_B"]) == 1
