"""The command-line tools driven as an operator would: qflow-config,
qflow-stat, qflow-send and qflow-receive as subprocesses against a qflowd
started on free loopback ports. What the broker did is checked only through
the management API (or the tools' own output).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import trio

import qflow
from tests.conftest import Daemon

BIN = Path(sys.executable).parent
DEADLINE = 60.0  # seconds for anything to happen on a slow machine; never a timing assertion



def command(name: str) -> list[str]:
    """The installed console script, or its module when the venv has none."""
    exe = BIN / name
    return [str(exe)] if exe.exists() else [sys.executable, "-m", f"qflow.cli.{name.replace('-', '_')}"]


def run(name: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command(name) + list(args), capture_output=True, text=True, input=stdin,
                          timeout=DEADLINE, stdin=None if stdin is not None else subprocess.DEVNULL)


def run_many(*calls: tuple[str, ...]) -> list[subprocess.CompletedProcess[str]]:
    """Independent tool runs, started together: most of a run is Python starting up."""
    procs = [subprocess.Popen(command(name) + list(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name, *args in calls]
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def config(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return run("qflow-config", "-b", f"127.0.0.1:{d.port}", *args)


def ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, (result.args, result.stdout, result.stderr)
    return result.stdout


def refused(result: subprocess.CompletedProcess[str], code: int, text: str) -> None:
    assert result.returncode == code, (result.args, result.returncode, result.stdout, result.stderr)
    assert text in result.stderr, (result.args, result.stderr)
    assert "Traceback" not in result.stderr


def api(d: Daemon, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}{path}", timeout=DEADLINE) as response:
        return json.loads(response.read())


def queue(d: Daemon, name: str) -> dict[str, Any]:
    return api(d, "/api/queues/" + quote(name, safe=""))


def wait_for(what: str, check: Any, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + DEADLINE
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


# -- qflow-config ---------------------------------------------------------------------


@pytest.mark.native_only
def test_qpid_config_round_trip(daemon: Daemon) -> None:
    d = daemon
    ok(config(d, "add", "queue", "orders", "--durable", "--max-queue-size", "2000000", "--max-queue-count", "5000",
              "--limit-policy", "reject", "--flow-stop-size", "1500000", "--flow-resume-size", "1000000",
              "--flow-stop-count", "4000", "--flow-resume-count", "3000", "--argument", "x-team=billing",
              "--argument", "x-retries=3"))
    q = queue(d, "orders")
    assert q["durable"] is True
    assert q["arguments"] == {"qpid.max_size": 2000000, "qpid.max_count": 5000, "qpid.policy_type": "reject",
                              "qpid.flow_stop_size": 1500000, "qpid.flow_resume_size": 1000000,
                              "qpid.flow_stop_count": 4000, "qpid.flow_resume_count": 3000,
                              "x-team": "billing", "x-retries": 3}
    assert (q["flowStopCount"], q["flowResumeCount"], q["flowStopSize"], q["flowResumeSize"]) == (
        4000, 3000, 1500000, 1000000)
    # Options after the command or before it, as qpid-config allows.
    ok(run("qflow-config", "add", "exchange", "topic", "events", "-b", f"127.0.0.1:{d.port}"))
    ok(config(d, "bind", "events", "orders", "order.#"))
    ok(config(d, "modify", "queue", "orders", "--flow-stop-count", "4500", "--flow-resume-count", "4000"))
    assert (queue(d, "orders")["flowStopCount"], queue(d, "orders")["flowResumeCount"]) == (4500, 4000)

    listing = ok(config(d, "queues", "orders"))
    header, rule, row = listing.splitlines()
    for column in ("Queue Name", "msg", "bytes", "stopCount", "resumeCount", "stopSize", "resumeSize",
                   "flowStopped", "stops", "held"):
        assert column in header
    assert row.split()[:8] == ["orders", "0", "0", "4500", "4000", "1500000", "1000000", "0"]
    assert "--durable" in row and "--max-queue-count=5000" in row and "--argument=x-team=billing" in row
    recursive = ok(config(d, "queues", "-r", "orders"))
    assert recursive.splitlines() == ["Queue 'orders'", "    bind [orders] => ''", "    bind [order.#] => events"]
    exchanges = ok(config(d, "exchanges"))
    assert any(line.split()[:3] == ["topic", "events", "1"] for line in exchanges.splitlines())
    assert "    bind [order.#] => orders" in ok(config(d, "exchanges", "-r", "events"))
    summary = ok(config(d))
    assert "Total Queues" in summary and "Total Exchanges" in summary

    ok(config(d, "unbind", "events", "orders", "order.#"))
    assert api(d, "/api/bindings") == []
    ok(config(d, "del", "exchange", "events"))
    ok(config(d, "del", "queue", "orders"))
    assert "orders" not in [q["name"] for q in api(d, "/api/queues")]


@pytest.mark.native_only
def test_default_ratios_through_the_api(daemon: Daemon) -> None:
    d = daemon
    ok(config(d, "add", "queue", "ratios", "--max-queue-count=10000", "--max-queue-size=1000000"))
    q = queue(d, "ratios")
    assert (q["flowStopCount"], q["flowResumeCount"]) == (8000, 7000)
    assert (q["flowStopSize"], q["flowResumeSize"]) == (800000, 700000)
    # A ring queue gets no default flow control, as in qpidd.
    ok(config(d, "add", "queue", "ring", "--max-queue-count=100", "--limit-policy", "ring"))
    assert queue(d, "ring")["flowStopCount"] == 0
    ok(config(d, "del", "queue", "ratios"))
    ok(config(d, "del", "queue", "ring"))


@pytest.mark.native_only
@pytest.mark.native_only
def test_qpid_config_thresholds_resolve_as_qpidd(daemon: Daemon) -> None:
    """add queue and modify queue go through qpidd's resolution (qflow.broker.settings): the broker's
    percentages pre-fill all four thresholds, and each option replaces its own value only."""
    d = daemon
    ok(config(d, "add", "queue", "qpidd-r1", "--max-queue-count", "1000", "--flow-stop-count", "900"))
    q = queue(d, "qpidd-r1")  # resumes at 70 % of 1000, keeps the size thresholds of the 100 MB default limit
    assert (q["flowStopCount"], q["flowResumeCount"], q["flowStopSize"], q["flowResumeSize"]) == (
        900, 700, 83886080, 73400320)
    # modify: the queue's arguments plus the change, resolved again: the resume count is pre-filled again.
    ok(config(d, "modify", "queue", "qpidd-r1", "--max-queue-count", "2000", "--flow-stop-count", "1600"))
    q = queue(d, "qpidd-r1")
    assert (q["flowStopCount"], q["flowResumeCount"]) == (1600, 1400)
    ok(config(d, "add", "queue", "qpidd-r2", "--flow-resume-count", "5"))  # resume without stop: accepted
    assert queue(d, "qpidd-r2")["flowResumeCount"] == 5
    # A stop size alone is refused: the pre-filled resume size (70 % of 100 MB) is larger.
    result = config(d, "add", "queue", "qpidd-r3", "--flow-stop-size", "5000")
    assert result.returncode == 1
    assert "qpid.flow_resume_size=73400320" in result.stderr and "qpid.flow_stop_size=5000" in result.stderr
    for name in ("qpidd-r1", "qpidd-r2"):  # the daemon is shared by the module's tests
        ok(config(d, "del", "queue", name))


def test_refusals_have_messages_and_exit_codes(daemon: Daemon) -> None:
    d = daemon
    b = f"127.0.0.1:{d.port}"
    m = f"127.0.0.1:{d.port}"
    ok(config(d, "add", "queue", "full", "--max-queue-count", "3", "--flow-stop-count", "0"))
    # Broker refusals: exit 1, the broker's message on stderr.
    expected = [
        (("qflow-config", "-b", m, "add", "queue", "bad", "--flow-stop-count", "5", "--flow-resume-count", "10"),
         "qpid.flow_resume_count=10 must be less than or equal to qpid.flow_stop_count=5"),
        (("qflow-config", "-b", m, "add", "queue", "full", "--durable"), "already exists"),
        (("qflow-config", "-b", m, "del", "queue", "missing"), "'missing' not found"),
        (("qflow-config", "-b", m, "add", "exchange", "bogus", "ex"), "type must be one of"),
        (("qflow-config", "-b", m, "unbind", "amq.direct", "full", "k"), "is not bound"),
        (("qflow-config", "-b", m, "modify", "queue", "full", "--max-queue-count", "1", "--flow-stop-count", "2"),
         "qpid.flow_stop_count=2 must be less than or equal to qpid.max_count=1"),
        (("qflow-config", "-b", "127.0.0.1:1", "queues"), "cannot reach"),
        (("qflow-send", "-b", b, "-a", "missing"), "queue 'missing' not found"),
        (("qflow-send", "-b", b, "-a", "nowhere/key"), "exchange 'nowhere' not found"),
        (("qflow-receive", "-b", b, "-a", "missing"), "'missing' not found"),
        (("qflow-send", "-b", "127.0.0.1:1", "-a", "full"), "cannot connect"),
    ]
    for result, (_call, text) in zip(run_many(*(call for call, _ in expected)), expected, strict=True):
        refused(result, 1, text)

    # A full reject queue refuses the fourth transfer: qflow-send exits 1 with the broker's message.
    refused(run("qflow-send", "-b", b, "-a", "full", "--messages", "5", "--content-string", "x"), 1,
            "queue 'full' is full")
    assert queue(d, "full")["msgDepth"] == 3 and queue(d, "full")["discardsOverflow"] >= 1
    refused(config(d, "del", "queue", "full"), 1, "not empty (3 messages)")
    ok(config(d, "del", "queue", "full", "--force"))

    # Usage errors: exit 2, with the usage.
    usage = [("qflow-config", "-b", m, *args) for args in (
        ["add", "queue"], ["add", "queue", "q", "--limit-policy", "drop"], ["frob"],
        ["add", "queue", "q", "--argument", "x"])]
    usage += [("qflow-send", "-a", "q", "--capacity", "-1"), ("qflow-receive", "-a", "q", "--print-content", "maybe"),
              ("qflow-stat", "-q", "-c")]
    for call, result in zip(usage, run_many(*usage), strict=True):
        assert result.returncode == 2, (call, result.stderr)
        assert "usage" in result.stderr.lower() and "Traceback" not in result.stderr
    assert not {"full", "bad", "q"} & {q["name"] for q in api(d, "/api/queues")}


# -- qflow-send and qflow-receive -----------------------------------------------------------


@pytest.mark.native_only
def test_send_and_receive(daemon: Daemon) -> None:
    d = daemon
    b = f"127.0.0.1:{d.port}"
    ok(config(d, "add", "queue", "greetings"))
    sent = ok(run("qflow-send", "-b", b, "-a", "greetings", "--messages", "3", "--content-string", "hello",
                  "--report-total"))
    # qpid-send's --report-total: one column, the throughput.
    assert sent.splitlines()[0] == "tp(m/s)" and sent.splitlines()[1].isdigit()
    ok(run("qflow-send", "-b", b, "-a", "greetings", "--content-stdin", "--durable", stdin="one\ntwo\n"))
    ok(config(d, "bind", "amq.direct", "greetings", "k"))
    ok(run("qflow-send", "-b", b, "-a", "amq.direct/k", "--content-size", "4"))
    assert queue(d, "greetings")["msgDepth"] == 6
    got = run("qflow-receive", "-b", b, "-a", "greetings", "--messages", "5", "--timeout", "10")
    # Not a terminal: the bodies and nothing else, no progress bar.
    assert ok(got).splitlines() == ["hello", "hello", "hello", "one", "two"] and got.stderr == ""
    # Everything printed was accepted: only the last message remains.
    assert queue(d, "greetings")["msgDepth"] == 1
    rest = ok(run("qflow-receive", "-b", b, "-a", "greetings", "--timeout", "1", "--print-content", "no",
                  "--report-total"))
    # No latencies (qflow-send stamps only with --timestamp yes), and no header of columns left empty.
    assert rest.splitlines() == ["tp(m/s)", rest.splitlines()[1]] and rest.splitlines()[1].isdigit()
    empty = run("qflow-receive", "-b", b, "-a", "greetings", "--timeout", "0.5")
    assert ok(empty) == ""
    ok(config(d, "del", "queue", "greetings"))


@pytest.mark.native_only
def test_report_total_latency_columns(daemon: Daemon) -> None:
    """qpid-receive's --report-total: a header ``tp(m/s) l-min l-max l-avg``
    (tab-separated), the throughput, and the latencies in ms from the send
    time qflow-send stamps in the ``ts`` property with --timestamp yes
    (qpid-send's option; qflow-send's default is no); without stamps the
    latencies are left out, and their header too."""
    d = daemon
    b = f"127.0.0.1:{d.port}"
    ok(config(d, "add", "queue", "stamped"))
    before = time.time_ns()
    ok(run("qflow-send", "-b", b, "-a", "stamped", "--messages", "20", "--content-size", "8", "--timestamp", "yes"))
    got = ok(run("qflow-receive", "-b", b, "-a", "stamped", "--messages", "20", "--timeout", "30",
                 "--print-content", "no", "--report-total"))
    header, values = got.splitlines()
    assert header == "tp(m/s)\tl-min\tl-max\tl-avg"
    tp, low, high, avg = values.split("\t")
    assert tp.isdigit() and all(re.fullmatch(r"\d+\.\d\d", v) for v in (low, high, avg)), values
    assert float(low) <= float(avg) <= float(high)
    # The latency cannot exceed the time since before the sender started.
    assert float(high) <= (time.time_ns() - before) / 1e6

    ok(run("qflow-send", "-b", b, "-a", "stamped", "--messages", "3"))  # the default: no stamps
    got = ok(run("qflow-receive", "-b", b, "-a", "stamped", "--messages", "3", "--timeout", "30",
                 "--print-content", "no", "--report-total"))
    header, values = got.splitlines()
    assert header == "tp(m/s)" and values.isdigit()  # no stamp: no latency, nor its columns' header

    async def one_stamp() -> object:  # what qflow-send puts there: qpid-send's ts, ns since the epoch
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            receiver = await ssn.receiver("stamped")
            return (await receiver.fetch(30)).headers.get("ts")

    ok(run("qflow-send", "-b", b, "-a", "stamped", "--messages", "1", "--timestamp", "yes"))
    stamp = trio.run(one_stamp)
    assert type(stamp) is int and before <= stamp <= time.time_ns()
    ok(config(d, "del", "queue", "stamped", "--force"))


def test_three_senders_under_flow_control(daemon: Daemon) -> None:
    """The manual's example, observed only through the management API: three
    senders with windows of 10, 20 and 30 against a stop threshold of 50."""
    d = daemon
    b = f"127.0.0.1:{d.port}"
    stop, capacities, per_sender = 50, (10, 20, 30), 200
    ok(config(d, "add", "queue", "flow", "--flow-stop-count", str(stop), "--flow-resume-count", "30",
              "--max-queue-count", "1000"))
    senders = [subprocess.Popen(command("qflow-send") + [
        "-b", b, "-a", "flow", "--messages", str(per_sender), "--capacity", str(c), "--content-size", "100",
        "--connection-name", f"sender-{c}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in capacities]
    try:
        def all_held() -> list[dict[str, Any]] | None:
            # Each sender stops once its whole window is held: then nothing moves until a consumer comes.
            sessions = [s for c in api(d, "/api/connections") if c["name"].startswith("sender-")
                        for s in c["sessions"]]
            if sorted(s["senderCapacity"] for s in sessions) == list(capacities) and all(
                    s["heldTransfers"] == s["senderCapacity"] for s in sessions):
                return sessions
            return None

        sessions = wait_for("every sender to be held", all_held)
        q = queue(d, "flow")
        assert q["flowStopped"] is True and q["flowStoppedCount"] == 1
        assert stop < q["msgDepth"] <= stop + sum(capacities)
        assert q["heldTransfers"] == q["msgDepth"] - stop
        for s in sessions:
            assert s["flowStopped"] is True and [h["queue"] for h in s["heldBy"]] == ["flow"]
            assert s["heldBy"][0]["since"]
        assert all(p.poll() is None for p in senders)  # still waiting, not failed

        # qflow-stat shows the same picture.
        stat_q = ok(run("qflow-stat", "-b", f"127.0.0.1:{d.port}", "-q"))
        (row,) = [line for line in stat_q.splitlines() if line.startswith("flow ")]
        assert row.split()[-3:] == ["Y", "1", str(q["heldTransfers"])]
        stat_c = ok(run("qflow-stat", "-b", f"127.0.0.1:{d.port}", "-c"))
        assert sum("flow (" in line for line in stat_c.splitlines() if "sender-" in line) == 3

        # Drain: the senders complete and exit 0, and the queue ends empty with flow resumed.
        total = per_sender * len(capacities)
        received = ok(run("qflow-receive", "-b", b, "-a", "flow", "--messages", str(total), "--timeout", "30",
                          "--print-content", "no", "--capacity", "100", "--report-total"))
        assert received.splitlines()[0] == "tp(m/s)"  # the senders did not stamp: no latency columns
        assert received.splitlines()[1].split("\t")[0].isdigit()
        for p in senders:
            out, err = p.communicate(timeout=DEADLINE)
            assert p.returncode == 0, err
    finally:
        for p in senders:
            if p.poll() is None:
                p.kill()
                p.wait()
    q = queue(d, "flow")
    assert (q["msgDepth"], q["flowStopped"], q["heldTransfers"]) == (0, False, 0)
    assert q["msgTotalEnqueues"] == q["msgTotalDequeues"] == per_sender * len(capacities)
    assert q["flowStoppedCount"] >= 1
    ok(config(d, "del", "queue", "flow"))


# -- qflow-stat -----------------------------------------------------------------------


@pytest.mark.native_only
def test_stat_views_and_watch(daemon: Daemon) -> None:
    d = daemon
    mgmt = f"127.0.0.1:{d.port}"
    ok(config(d, "add", "queue", "watched"))
    general = ok(run("qflow-stat", "-b", mgmt))
    assert "Broker Summary" in general and "qflowd" in general
    assert "watched" in ok(run("qflow-stat", "-b", mgmt, "-q", "-S", "msg", "-L", "5"))
    assert run("qflow-stat", "-b", mgmt, "-q", "-S", "nope").returncode == 1

    watch = subprocess.Popen(command("qflow-stat") + ["-b", mgmt, "-q", "--watch", "0.2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        seen = 0
        deadline = time.monotonic() + DEADLINE
        while seen < 2 and time.monotonic() < deadline:
            line = watch.stdout.readline()
            seen += line.startswith("Queues")
        assert seen == 2  # refreshed at least once
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=DEADLINE) == 0  # Ctrl-C is the way out of --watch
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()
    ok(config(d, "del", "queue", "watched"))


@pytest.mark.native_only
def test_api_is_reachable_by_plain_http(daemon: Daemon) -> None:
    # What an operator's curl sees for a missing queue: a 404 with a JSON message.
    with pytest.raises(urllib.error.HTTPError) as info:
        api(daemon, "/api/queues/none")
    assert info.value.code == 404 and "not found" in json.loads(info.value.read())["error"]
