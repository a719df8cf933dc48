"""qflowd's settings from three places, as qpidd takes them: ``--config FILE``
(one ``name=value`` a line, the long options' names), QFLOWD_* environment
variables (QPID_* for qpidd), and the command line. The command line wins,
then the environment, then the file."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from qflow.cli.qflowd import parse_args

from qflow.testing import start

DEADLINE = 60.0


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "qflowd.conf"
    path.write_text(text)
    return str(path)


def test_the_command_line_wins_then_the_environment_then_the_file(tmp_path: Path) -> None:
    conf = write(tmp_path, "# as qpidd.conf: the long options' names\n"
                           "port=6001\nmgmt-port=6002\nlog-level=debug\ndefault-queue-limit=1000\n\n")
    env = {"QFLOWD_MGMT_PORT": "7002", "QFLOWD_LOG_LEVEL": "warning"}
    args = parse_args(["--config", conf, "--log-level", "error"], env)
    assert args.port == 6001  # the file alone
    assert args.mgmt_port == 7002  # the environment over the file
    assert args.log_level == "error"  # the command line over both
    assert args.default_queue_limit == 1000
    # Nothing given anywhere: the defaults.
    plain = parse_args([], {})
    assert (plain.port, plain.log_level, plain.default_queue_limit) == (5672, "info", 104857600)


def test_config_file_from_the_environment_and_flags(tmp_path: Path) -> None:
    conf = write(tmp_path, "no-data-dir=yes\nport = 6100\n")
    args = parse_args([], {"QFLOWD_CONFIG": conf})
    assert args.data_dir is None and args.port == 6100
    # The command line's --data-dir wins over the file's no-data-dir.
    assert parse_args(["--data-dir", str(tmp_path)], {"QFLOWD_CONFIG": conf}).data_dir == str(tmp_path)
    # "no" undoes it.
    assert parse_args([], {"QFLOWD_CONFIG": conf, "QFLOWD_NO_DATA_DIR": "no"}).data_dir == "~/.qflowd"


@pytest.mark.parametrize(("text", "env", "message"), [
    ("port=6001\nbogus=1\n", {}, "qflowd.conf:2: unknown option 'bogus'"),
    ("port=many\n", {}, "qflowd.conf:1: bad value 'many' for port"),
    ("just words\n", {}, "qflowd.conf:1: expected NAME=VALUE"),
    ("log-level=loud\n", {}, "log-level must be one of debug, info, warning, error"),
    ("no-data-dir=perhaps\n", {}, "no-data-dir is a flag"),
    ("", {"QFLOWD_PROT": "1"}, "QFLOWD_PROT: unknown option 'prot'"),
    ("", {"QFLOWD_PORT": "abc"}, "QFLOWD_PORT: bad value 'abc' for port: expected a whole number"),
    ("", {"QFLOWD_MGMT_TIMEOUT": "soon"}, "QFLOWD_MGMT_TIMEOUT: bad value 'soon' for mgmt-timeout: expected a number"),
    ("", {"QFLOWD_DEFAULT_FLOW_STOP_THRESHOLD": "120"}, "threshold"),
])
def test_bad_settings_refused_naming_where(tmp_path: Path, text: str, env: dict[str, str], message: str) -> None:
    conf = write(tmp_path, text)
    result = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--config", conf, "--no-data-dir"],
                            capture_output=True, text=True, timeout=DEADLINE, env={"PATH": "/usr/bin:/bin", **env},
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "invalid literal" not in result.stderr and "could not convert" not in result.stderr


def test_missing_config_file_refused(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--config", str(tmp_path / "none.conf")],
                            capture_output=True, text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "cannot read it" in result.stderr


@pytest.mark.native_only
def test_a_real_qflowd_takes_all_three(tmp_path: Path) -> None:
    conf = write(tmp_path, "default-flow-stop-threshold=50\ndefault-flow-resume-threshold=40\n"
                           "default-queue-limit=1000\nlog-format=json\n")
    log = tmp_path / "qflowd.log"


    d = start("--config", conf, "--default-queue-limit", "2000", "--no-data-dir", log=str(log),
              env={"QFLOWD_DEFAULT_FLOW_STOP_THRESHOLD": "60"})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}/api/broker", timeout=DEADLINE) as response:
            options = json.loads(response.read())["options"]
    finally:
        d.stop()
    assert options["defaultFlowStopThreshold"] == 60  # the environment over the file
    assert options["defaultFlowResumeThreshold"] == 40  # the file
    assert options["defaultQueueLimit"] == 2000  # the command line over the file
    lines = log.read_text().splitlines()
    assert lines and all(json.loads(line)["level"] for line in lines)  # log-format=json, from the file


