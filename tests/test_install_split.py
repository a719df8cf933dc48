"""What ``make run`` and ``make test`` install: the broker and its tools only, or
those plus the test extras; neither reinstalls what the other installed already;
``make run DATA_DIR=...`` passes ``--data-dir``. The Makefile runs in a copy of
the checkout's packaging files with a stand-in venv whose python and qflowd
only write down how they were called, so nothing is installed or started.
Also: the Spark extra and docs/spark.md's install from the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
"""


def make(tmp: Path, *args: str) -> list[str]:
    """Run make in ``tmp``; returns the calls of the stand-in python and qflowd it made."""
    log = tmp / "calls.log"
    log.unlink(missing_ok=True)
    done = subprocess.run(["make", "--no-print-directory", *args], cwd=tmp, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return log.read_text().splitlines() if log.exists() else []


def checkout(tmp: Path) -> Path:
    for name in ("Makefile", "pyproject.toml", "setup.py", "native/shared_header.py", "qflow/broker/ops.py"):
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp / name)
    bin_dir = tmp / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "qflowd"):
        (bin_dir / name).write_text(FAKE.format(log=tmp / "calls.log"))
        (bin_dir / name).chmod(0o755)
    old = time.time() - 100  # the packaging as checked out, and the venv made before anything was installed
    for path in (bin_dir / "python", tmp / "pyproject.toml", tmp / "setup.py", tmp / "native/shared_header.py",
                 tmp / "qflow/broker/ops.py"):
        os.utime(path, (old, old))
    return tmp


def pip_installs(calls: list[str]) -> list[str]:
    return [c for c in calls if " -m pip install " in c]


def test_make_run_installs_the_broker_only_and_passes_the_data_dir(tmp_path: Path) -> None:
    tmp = checkout(tmp_path)
    calls = make(tmp, "run", "PORT=5999", "MGMT_PORT=8999", "DATA_DIR=/srv/qflow data")
    assert pip_installs(calls) == ["python -m pip install --quiet -e ."]
    assert calls[-1] == "qflowd --host 127.0.0.1 --port 5999 --mgmt-port 8999 --data-dir /srv/qflow data"
    # Again: nothing to install; without DATA_DIR, qflowd's own default.
    calls = make(tmp, "run")
    assert calls == ["qflowd --host 127.0.0.1 --port 5672 --mgmt-port 8672"]


def test_the_test_install_adds_the_extras_and_make_run_after_it_installs_nothing(tmp_path: Path) -> None:
    tmp = checkout(tmp_path)
    assert pip_installs(make(tmp, "run")) == ["python -m pip install --quiet -e ."]
    # make test's install, after make run's: the extras are added.
    assert pip_installs(make(tmp, ".venv/.installed")) == ["python -m pip install --quiet -e .[test]"]
    # The packaging changes; make test's install first, then make run has nothing left to do.
    time.sleep(0.01)
    (tmp / "pyproject.toml").touch()
    assert pip_installs(make(tmp, ".venv/.installed")) == ["python -m pip install --quiet -e .[test]"]
    assert pip_installs(make(tmp, "run")) == []


def test_make_run_after_the_test_install_installs_nothing(tmp_path: Path) -> None:
    tmp = checkout(tmp_path)
    assert pip_installs(make(tmp, ".venv/.installed")) == ["python -m pip install --quiet -e .[test]"]
    assert pip_installs(make(tmp, "install")) == []
    assert pip_installs(make(tmp, "run")) == []


def test_make_install_and_run_do_not_need_chromium() -> None:
    done = subprocess.run(["make", "-n", "-p", "install", "run"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    rules = {line.split(":", 1)[0]: line.split(":", 1)[1] for line in done.stdout.splitlines()
             if line.startswith(("install:", "run:"))}
    assert rules and all("chromium" not in deps and ".installed-run" in deps for deps in rules.values()), rules


def test_spark_is_an_extra_installed_from_the_checkout() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["spark"]) <= set(extras["test"])  # make test still runs the Spark tests
    spark_doc = (ROOT / "docs" / "spark.md").read_text()
    assert "pip install 'qflow[spark]'" not in spark_doc  # PyPI's qflow is an unrelated project
    assert "pip install -e '.[spark]'" in spark_doc
