"""Run the test suite N times (JOBS at once) and report every test that failed
at least once: ``make test-repeat N=10 [JOBS=2]``.

Each run is both passes of ``make test`` (QFLOW_ACCOUNTING=native, then
python), each writing a JUnit report; the failures of all runs are tallied by
test id. Exits 1 if any test failed in any run, so flakiness is caught before
it lands. JOBS=2 runs two suites at once, competing for the cores.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor

PASSES = [("native", []), ("python", ["-m", "not native_only"])]


def run_once(index: int, report_dir: str, extra: list[str]) -> tuple[int, float, list[str], str]:
    """One whole suite; returns (run index, seconds, failed test ids, last summary line)."""
    failed: list[str] = []
    summary = []
    start = time.monotonic()
    for accounting, args in PASSES:
        xml = os.path.join(report_dir, f"run{index}-{accounting}.xml")
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={xml}", *args, *extra],
            env={**os.environ, "QFLOW_ACCOUNTING": accounting}, capture_output=True, text=True)
        lines = proc.stdout.strip().splitlines()
        summary.append(f"{accounting}: {lines[-1] if lines else '(no output)'}")
        failed += [f"{accounting}::{t}" for t in failures(xml)]
        if proc.returncode not in (0, 1):  # 1 is failed tests, counted above; others are a broken run
            failed.append(f"{accounting}::<pytest exited {proc.returncode}>")
    return index, time.monotonic() - start, failed, "; ".join(summary)


def failures(xml: str) -> list[str]:
    if not os.path.exists(xml):
        return ["<no report>"]
    out = []
    for case in ET.parse(xml).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"{case.get('classname')}::{case.get('name')}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", type=int, default=10, help="how many runs (default 10)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (default 1)")
    p.add_argument("pytest_args", nargs="*", help="passed on to pytest")
    args = p.parse_args()
    tally: collections.Counter[str] = collections.Counter()
    with tempfile.TemporaryDirectory(prefix="qflow-repeat-") as report_dir, \
            ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_once, i, report_dir, args.pytest_args) for i in range(1, args.n + 1)]
        for future in futures:
            index, seconds, failed, summary = future.result()
            tally.update(set(failed))
            print(f"run {index}/{args.n} ({seconds:.0f} s): {summary}", flush=True)
    if not tally:
        print(f"test-repeat: no test failed in {args.n} runs ({args.jobs} at once)")
        return 0
    print(f"test-repeat: {len(tally)} tests failed at least once in {args.n} runs ({args.jobs} at once):")
    for test, count in tally.most_common():
        print(f"  {count}/{args.n}  {test}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
