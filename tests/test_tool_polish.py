"""The tools' finish: qflow-stat -u and -q NAME, --version and shell
completion on every tool, Qpid's 0 values (--timeout 0 waits forever,
--capacity 0, --send-rate 0), and a progress bar that says how long the
sender is held and that log lines never write across."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import trio
from qflow.cli._output import bar_logging, held_text
from qflow.cli.qflow_receive import build_parser as receive_parser
from qflow.cli.qflow_send import build_parser as send_parser
from tqdm import tqdm

import qflow
from tests.conftest import Daemon, table_after

BIN = Path(sys.executable).parent
DEADLINE = 60.0
TOOLS = ("qflowd", "qflow-config", "qflow-stat", "qflow-send", "qflow-receive", "qflow-passwd")


def run(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / name), *args], capture_output=True, text=True, timeout=DEADLINE,
                          stdin=subprocess.DEVNULL)



def api(d: Daemon, path: str) -> object:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}{path}", timeout=DEADLINE) as response:
        return json.loads(response.read())


@pytest.mark.native_only
@pytest.mark.parametrize("name", TOOLS)
def test_version_and_completion(name: str) -> None:
    version = run(name, "--version")
    assert version.returncode == 0 and re.fullmatch(rf"{name} \(qflow\) \d+\.\d+\.\d+\n", version.stdout)
    script = run(name, "--print-completion", "bash")
    assert script.returncode == 0 and "complete" in script.stdout and "--version" in script.stdout


@pytest.mark.native_only
async def test_subscriptions_and_one_queue(daemon: Daemon) -> None:
    d = daemon
    b = f"127.0.0.1:{d.port}"
    async with qflow.open_connection("127.0.0.1", d.port, name="watcher") as conn:
        ssn = await conn.session("watch-session")
        await ssn.declare_queue("subscribed", arguments={"qpid.max_count": 50})
        sender = ssn.sender("subscribed")
        await sender.send_many([b"m"] * 3)
        await sender.sync()
        receiver = await ssn.receiver("subscribed", capacity=10, accept="explicit")
        for _ in range(3):
            await receiver.fetch(timeout=DEADLINE)
        out = await trio.run_process([str(BIN / "qflow-stat"), "-b", b, "-u"], capture_stdout=True,
                                     capture_stderr=True)
        lines = out.stdout.decode().splitlines()
        assert lines[1].split() == ["subscr", "queue", "conn", "connName", "protocol", "session", "browse", "acked",
                                    "excl", "creditMode", "delivered"]
        (row,) = [line.split() for line in lines[3:] if " subscribed " in line]
        assert row[1] == "subscribed" and row[3] == "watcher" and row[4] == "qflow" and row[5] == "watch-session"
        assert row[-1] == "3" and "Y" in row  # acked: explicit accept
        subs = [s for s in api(d, "/api/subscriptions") if s["queue"] == "subscribed"]
        assert len(subs) == 1 and subs[0]["delivered"] == 3 and subs[0]["acked"] is True
        assert subs[0]["browse"] is False

        one = await trio.run_process([str(BIN / "qflow-stat"), "-b", b, "-q", "subscribed"], capture_stdout=True)
        text = one.stdout.decode()
        assert text.startswith("Properties of queue 'subscribed'")
        fields = dict(line.split(None, 1) for line in text.splitlines()[1:])
        assert fields["msgDepth"] == "3" and fields["consumerCount"] == "1" and fields["policyType"] == "reject"
    missing = run("qflow-stat", "-b", b, "-q", "no-such-queue")
    assert missing.returncode == 1 and "'no-such-queue' not found" in missing.stderr


def test_qpid_zero_values_parse() -> None:
    args = receive_parser().parse_args(["-a", "q", "--timeout", "0", "--capacity", "0"])
    assert (args.timeout, args.capacity) == (0, 0)
    args = send_parser().parse_args(["-a", "q", "--capacity", "0", "--send-rate", "0"])
    assert (args.capacity, args.send_rate) == (0, 0)
    for parser, bad in ((send_parser, ["--capacity", "-1"]), (receive_parser, ["--timeout", "-1"])):
        with pytest.raises(SystemExit):
            parser().parse_args(["-a", "q", *bad])


@pytest.mark.native_only
def test_qpid_zero_values_end_to_end(daemon: Daemon) -> None:
    d = daemon
    b = f"127.0.0.1:{d.port}"
    assert run("qflow-config", "-b", b, "add", "queue", "zeros").returncode == 0
    # --timeout 0: waits for a message however long it takes.
    waiting = subprocess.Popen([str(BIN / "qflow-receive"), "-b", b, "-a", "zeros", "--timeout", "0",
                                "--messages", "4", "--capacity", "0"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + DEADLINE
        while not [s for s in api(d, "/api/subscriptions") if s["queue"] == "zeros"]:
            assert waiting.poll() is None, waiting.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # Well past the default timeout of 1 s would be a timing assertion: instead, the receiver must still be
        # there after a whole send of the first message ... and must take all four.
        sent = run("qflow-send", "-b", b, "-a", "zeros", "--capacity", "0", "--send-rate", "0", "--messages", "4",
                   "--content-string", "z")
        assert sent.returncode == 0, sent.stderr
        out, err = waiting.communicate(timeout=DEADLINE)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 0 and out == "z\n" * 4, err
    assert run("qflow-config", "-b", b, "del", "queue", "zeros").returncode == 0


def test_held_text() -> None:
    assert held_text({}, 10.0) == ""
    assert held_text({"orders": 10.0}, 22.5) == "held 12s by orders"
    assert held_text({"a": 5.0, "b": 1.0}, 200.0) == "held 3m19s by b (+1)"  # the longest hold first
    # A broker-wide holder is not a queue: it reads as what it is.
    assert held_text({"store disk quota": 2.0}, 4.0, {"store disk quota"}) == "held 2s by the store disk quota"


def test_log_lines_go_above_the_bar_never_across_it() -> None:
    """The tools log to stderr, where the bar is: tqdm clears the bar, writes the line, draws the bar again."""
    stream = io.StringIO()
    message = "send delayed by 5s due to broker flow control: held by queue orders"
    root = logging.getLogger()
    with contextlib.redirect_stderr(stream):
        handler = logging.StreamHandler()  # sys.stderr, as logging.basicConfig in qflow-send
        handler.setFormatter(logging.Formatter("qflow-send: %(message)s"))
        root.addHandler(handler)
        try:
            bar = tqdm(total=100, desc="qflow-send", file=sys.stderr, mininterval=0)
            bar.update(10)
            bar.set_postfix_str("held 5s by orders")
            with bar_logging(bar):
                logging.getLogger("qflow.client").warning(message)
            bar.close()
        finally:
            root.removeHandler(handler)
    parts = re.split(r"[\r\n]", stream.getvalue())
    assert f"qflow-send: {message}" in parts  # a line of its own: the bar was cleared first
    assert any("held 5s by orders" in p for p in parts)


def test_a_sessions_holds_name_queues_as_queues_and_holders_as_holders() -> None:
    from qflow.client.session import describe_holds

    held_by = {"orders": 5.0, "store disk quota": 1.0}  # name -> since: the longest hold first
    assert describe_holds(held_by, {"store disk quota"}) == "the store disk quota, queue orders"
    assert describe_holds({"memory alarm": 1.0}, {"memory alarm"}) == "the memory alarm"
    # A queue may be called anything, even what a holder is called: only the broker's flag makes a holder.
    assert describe_holds({"memory alarm": 1.0}, set()) == "queue memory alarm"
    assert describe_holds({}, set()) == ""


@pytest.mark.native_only
def test_the_tools_management_lookup_is_not_logged_at_info(tmp_path: Path) -> None:
    """qflow-config and qflow-stat find the management API through a probe connection: the broker
    logs it at debug, so a tool run adds no connection lines to an INFO log."""
    from qflow.testing import start

    quiet = start(log=str(tmp_path / "info.log"))
    loud = start("--log-level", "debug", log=str(tmp_path / "debug.log"))
    try:
        for d in (quiet, loud):
            b = f"127.0.0.1:{d.port}"
            assert run("qflow-config", "-b", b, "queues").returncode == 0
            assert run("qflow-stat", "-b", b, "-q").returncode == 0
    finally:
        quiet.stop()
        loud.stop()
    assert "opened: name 'qflow-" not in quiet.log() and "closed: name 'qflow-" not in quiet.log()
    for tool in ("qflow-config", "qflow-stat"):
        assert re.search(rf" DEBUG .*opened: name '{tool}\[\d+\]', user 'anonymous' \(a probe\)", loud.log())
        assert re.search(rf" DEBUG .*closed: name '{tool}\[\d+\]', user 'anonymous'", loud.log())


@pytest.mark.native_only
def test_stat_general_is_narrow_with_sizes_in_units_and_u_shows_session_0(daemon: Daemon) -> None:
    b = f"127.0.0.1:{daemon.port}"
    general = run("qflow-stat", "-b", b, "-g")
    assert general.returncode == 0, general.stderr
    assert max(len(line) for line in general.stdout.splitlines()) <= 100, general.stdout
    columns = table_after(general.stdout, "Resources")
    assert re.fullmatch(r"\d+(\.\d)?[KMGT]", columns["memoryUsed"]) and re.fullmatch(r"\d+B|\d+\.\d[KMGT]",
                                                                                     columns["storeSize"])
    assert table_after(general.stdout, "Broker Summary")["conn"].isdigit()

    async def subscribed() -> str:
        async with qflow.open_connection("127.0.0.1", daemon.port, name="zero") as conn:
            ssn = await conn.session()  # unnamed, on channel 0
            await ssn.declare_queue("on-session-0")
            await ssn.receiver("on-session-0")
            return (await trio.run_process([str(BIN / "qflow-stat"), "-b", b, "-u"], capture_stdout=True)).stdout

    text = trio.run(subscribed).decode()
    (row,) = [line.split() for line in text.splitlines() if " on-session-0 " in line]
    assert row[3:6] == ["zero", "qflow", "0"], text  # connName, protocol, then the session: its channel (no name)
