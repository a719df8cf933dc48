"""Hunt for rare disagreements: ``make fuzz [FUZZ_MINUTES=30] [FUZZ_SCALE=20]``.

Runs the differential and model Hypothesis tests (C against its Python twin,
transfer runs against frame by frame, the journal against its model, ...)
again and again, each round with a fresh random seed and ``FUZZ_SCALE``
times the examples ``make test`` draws, until the minutes are up. Each round
alternates the accounting (native, then python). The seed of every failing
round is printed with the command that replays it, so a disagreement found
here is a bug report, not a flake. Exits 1 if any round failed.

Not part of ``make test``, which keeps its example counts: CI gets one draw
per test, this gets thousands.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

# The differential and model tests: each compares two implementations, or an implementation
# with a model, over generated input.
TESTS = [
    "tests/test_accounting.py::test_native_matches_python",
    "tests/test_transfer_runs.py::test_runs_change_nothing_but_speed",
    "tests/test_deliver_runs.py",
    "tests/test_journal.py::test_model_a_crash_cut_at_any_byte_of_the_last_write_recovers_the_committed_state",
    "tests/test_journal.py::test_model_a_torn_record_in_the_middle_keeps_exactly_the_batches_before_it",
    "tests/test_journal_encoder.py",
    "tests/test_ranges.py::test_matches_a_plain_set",
    "tests/test_session.py",
    "tests/test_sync_thread.py::test_its_crc32_is_zlibs",
    "tests/test_framing.py::test_fuzz_random_bytes_after_header",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="how long to hunt (default 30)")
    p.add_argument("--scale", type=int, default=20, help="examples per test, times make test's (default 20)")
    p.add_argument("--seed", type=int, help="one round with this seed, then stop (replay a failure)")
    p.add_argument("tests", nargs="*", default=TESTS, help="test ids (default: the differential and model tests)")
    args = p.parse_args()
    if args.scale < 1:
        p.error(f"--scale must be at least 1, not {args.scale}")
    deadline = time.monotonic() + args.minutes * 60
    failures: list[tuple[int, str]] = []
    rounds = 0
    while True:
        seed = args.seed if args.seed is not None else random.randrange(1, 2**31)
        accounting = ("native", "python")[rounds % 2]
        env = dict(os.environ, QFLOW_FUZZ_SCALE=str(args.scale), QFLOW_ACCOUNTING=accounting)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--hypothesis-seed={seed}",
               *args.tests]
        started = time.monotonic()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        rounds += 1
        summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"round {rounds}: seed {seed}, {accounting}: {summary} ({time.monotonic() - started:.0f} s)",
              flush=True)
        if done.returncode != 0:
            replay = (f"QFLOW_FUZZ_SCALE={args.scale} QFLOW_ACCOUNTING={accounting} {' '.join(cmd[:-len(args.tests)])} "
                      f"{' '.join(args.tests)}")
            failures.append((seed, replay))
            print(done.stdout[-6000:], flush=True)
            print(f"FAILED with seed {seed}; replay: {replay}", flush=True)
        if args.seed is not None or time.monotonic() >= deadline:
            break
    print(f"fuzz: {rounds} rounds, {len(failures)} failed" +
          "".join(f"\n  seed {seed}: {replay}" for seed, replay in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
