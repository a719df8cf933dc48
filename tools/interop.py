"""The Apache Qpid Interop Test (QIT 2.0) against qflowd: its python-proton
and rhea shims, sending to each other through qflowd (``make interop``).

QIT is run from its own tree (built by the Makefile from the snapshot in
../shared/anchors into ~/.cache/qflow-anchors: its venv, the rhea shim's
node_modules); nothing of it is part of qflow. It names a queue per test
(``qit.test.<type>.<sender>.<receiver>``, ``qit.test.large.<random>``), so
each qflowd runs with ``--queue-patterns qit.# --queue-patterns test.#``.
Its large-content part checks the frame size each broker offers: one qflowd
offers the default (1 MiB), a second 4096 bytes.

Three parts: ``types`` (every AMQP type, QIT's ``qit test amqp-types``),
``headers`` (the header section's fields) and ``large`` (1 and 10 MB bodies
and collections, across frame sizes). Prints each part's counts, every test
that failed with its reason, and as its last line a JSON object with the
counts; exits 1 if any test failed. QIT's own known client issues (its
xfail list, e.g. JavaScript numbers above 2^53) are counted apart.

    python tools/interop.py --qit ~/.cache/qflow-anchors/qpid-interop-test-b8b89adf
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from qflow.testing import Daemon, start

SHIMS = ("python-proton", "javascript-rhea")
PATTERNS = ("--queue-patterns", "qit.#", "--queue-patterns", "test.#")
SMALL_FRAME = 4096


def run_part(part: str, qit: Path, brokers: dict[str, Daemon], out: Path, workers: int) -> Path:
    """Run one part of QIT; its JUnit XML report's path."""
    python = str(qit / ".venv" / "bin" / "python")
    env = dict(os.environ, PYTHONPATH=str(qit / "src"),
               QIT_BROKER_URL=f"127.0.0.1:{brokers['default'].port}",
               QIT_BROKER_URL_LARGE_FRAME=f"127.0.0.1:{brokers['default'].port}",
               QIT_BROKER_URL_SMALL_FRAME=f"127.0.0.1:{brokers['small'].port}")
    report = out / f"qit-{part}.xml"
    if part == "types":
        shims = [arg for shim in SHIMS for arg in ("--sender", shim, "--receiver", shim)]
        cmd = [python, "-m", "qit.cli.main", "test", "amqp-types", *shims,
               "--broker", f"amqp://127.0.0.1:{brokers['default'].port}", "--junit-xml", str(report)]
    else:
        test = {"headers": "tests/test_amqp_headers.py", "large": "tests/test_large_content.py"}[part]
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", str(workers), test,
               "--shims", ",".join(SHIMS), "--junit-xml", str(report)]
        if part == "large":
            cmd.append("--large-content")
    print(f"== {part}: {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, cwd=qit, env=env, stdout=subprocess.DEVNULL if part == "types" else None, check=False)
    return report


def counts(report: Path) -> dict[str, Any]:
    """Passed, failed (with reasons), known client issues and tests left out
    (other shims' pairs) in a JUnit XML report."""
    result: dict[str, Any] = {"passed": 0, "failed": [], "known": [], "other_shims": 0}
    if not report.exists():
        result["failed"].append(("(no report)", f"{report} was not written"))
        return result
    for case in ET.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((e for e in case if e.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            result["passed"] += 1
        elif outcome.tag == "skipped":
            message = outcome.get("message") or ""
            if "shims list" in message:
                result["other_shims"] += 1
            else:
                result["known"].append((name, message))
        else:
            result["failed"].append((name, (outcome.get("message") or outcome.text or "")[:300]))
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--qit", type=Path, required=True, help="QIT's built tree (the Makefile's QIT)")
    p.add_argument("--parts", default="types,headers,large", help="comma-separated: types, headers, large")
    p.add_argument("--workers", type=int, default=2, help="QIT's pytest-xdist workers (default 2)")
    args = p.parse_args()
    out = Path(tempfile.mkdtemp(prefix="qflow-interop-"))
    brokers: dict[str, Daemon] = {}
    summary: dict[str, Any] = {}
    try:
        brokers["default"] = start(*PATTERNS, log=str(out / "qflowd.log"))
        brokers["small"] = start(*PATTERNS, "--max-frame-size", str(SMALL_FRAME), log=str(out / "qflowd-small.log"))
        for part in args.parts.split(","):
            c = counts(run_part(part, args.qit, brokers, out, args.workers))
            summary[part] = c
            print(f"== {part}: {c['passed']} passed, {len(c['failed'])} failed, {len(c['known'])} known client "
                  f"issues (QIT's xfail list), {c['other_shims']} left out (other shims)", flush=True)
            for name, reason in c["failed"]:
                print(f"   FAILED {name}: {reason}")
            for name, reason in c["known"]:
                print(f"   known  {name}: {reason}")
    finally:
        for d in brokers.values():
            d.stop()
    print(f"reports and qflowd logs: {out}")
    total = {"passed": sum(c["passed"] for c in summary.values()),
             "failed": sum(len(c["failed"]) for c in summary.values()),
             "known_client_issues": sum(len(c["known"]) for c in summary.values())}
    print(json.dumps({"shims": list(SHIMS), **total,
                      **{f"{part}_passed": c["passed"] for part, c in summary.items()},
                      **{f"{part}_failed": len(c["failed"]) for part, c in summary.items()}}))
    return 1 if total["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
