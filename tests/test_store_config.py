"""The data directory and the durable configuration (issue 14), against real
qflowd processes that are SIGKILLed (or stopped) and started again on the same
data directory: the lock, what survives a restart and what does not, the
paths that declare (client commands, the management API, qflow-config), a
damaged configuration log, and a store that cannot write.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio

import qflow
from qflow.store.definitions import CONFIG_NAME, frame
from qflow.testing import Daemon, start

TIMEOUT = 60


def qflowd(data_dir: Path, *args: str) -> Daemon:
    """qflowd on ``data_dir``, its log in a file beside it (one per start)."""
    logs = sorted(data_dir.parent.glob("qflowd-*.log"))
    return start("--data-dir", str(data_dir), *args, log=str(data_dir.parent / f"qflowd-{len(logs)}.log"))


def api(d: Daemon, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def bindings(d: Daemon) -> set[tuple[str, str, str]]:
    status, found = api(d, "GET", "/api/bindings")
    assert status == 200
    return {(b["exchange"], b["queue"], b["key"]) for b in found}


def queue_names(d: Daemon) -> set[str]:
    return {q["name"] for q in api(d, "GET", "/api/queues")[1]}


def exchange_types(d: Daemon) -> dict[str, str]:
    return {e["name"]: e["type"] for e in api(d, "GET", "/api/exchanges")[1] if e["name"] and
            not e["name"].startswith("amq.")}


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


# -- the lock -------------------------------------------------------------------------------------------------
def test_a_second_qflowd_on_a_locked_data_dir_exits_1_naming_the_holder(data_dir: Path) -> None:
    first = qflowd(data_dir)
    try:
        second = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", "--data-dir", str(data_dir)],
                                capture_output=True, text=True, timeout=TIMEOUT)
        assert second.returncode == 1
        lines = second.stderr.strip().splitlines()
        assert f"qflowd: data directory {data_dir} is locked by process {first.proc.pid}" in lines[-1], second.stderr
        assert "Traceback" not in second.stderr
        assert not any(line.startswith("qflowd ready") for line in second.stdout.splitlines())
        assert first.proc.poll() is None  # the holder serves on
        assert api(first, "PUT", "/api/queues/still-here", {"durable": True})[0] == 201
    finally:
        first.stop()


def test_sigkill_leaves_no_stale_lock(data_dir: Path) -> None:
    first = qflowd(data_dir)
    first.kill()
    second = qflowd(data_dir)  # would raise if the directory were still locked
    try:
        assert (data_dir / "lock").read_text().strip() == str(second.proc.pid)
    finally:
        second.stop()
    assert oct(data_dir.stat().st_mode & 0o777) == oct(0o700)


@pytest.mark.parametrize("bad", ["file", "empty"])
def test_a_data_dir_that_cannot_be_one_is_refused(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "a-file"
    path.write_text("x")
    args = ["--data-dir", str(path)] if bad == "file" else ["--data-dir", ""]
    done = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", *args],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == (1 if bad == "file" else 2)
    last = done.stderr.splitlines()[-1]
    assert (f"qflowd: cannot create data directory {path}" if bad == "file" else "qflowd: --data-dir must name") \
        in last, done.stderr
    assert "Traceback" not in done.stderr


def test_no_data_dir_keeps_nothing(tmp_path: Path) -> None:
    d = start("--no-data-dir", log=str(tmp_path / "log"))
    try:
        assert api(d, "GET", "/api/broker")[1]["options"]["dataDir"] is None
        assert api(d, "PUT", "/api/queues/q", {"durable": True})[0] == 201
    finally:
        d.stop()
    assert "no data directory" in (tmp_path / "log").read_text()


def test_start_gives_each_daemon_a_temporary_data_dir_of_its_own() -> None:
    a, b = start(), start()
    try:
        dirs = [api(d, "GET", "/api/broker")[1]["options"]["dataDir"] for d in (a, b)]
        assert dirs[0] != dirs[1] and all(Path(p).is_dir() for p in dirs)
        assert not any(Path(p) == Path("~/.qflowd").expanduser() for p in dirs)
    finally:
        a.stop()
        b.stop()
    assert not any(Path(p).exists() for p in dirs)


# -- what survives ----------------------------------------------------------------------------------------------
THRESHOLD_KEYS = ("flowStopCount", "flowResumeCount", "flowStopSize", "flowResumeSize", "durable", "arguments")


async def test_durable_queues_survive_with_their_arguments_and_thresholds(data_dir: Path) -> None:
    orders_args = {"qpid.max_count": 1000, "qpid.flow_stop_count": 900, "qpid.policy_type": "reject",
                   "x-team": "billing"}
    ring_args = {"qpid.max_size": 5000, "qpid.policy_type": "ring"}
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("orders", durable=True, arguments=orders_args)
            await ssn.declare_queue("ring", durable=True, arguments=ring_args)
            await ssn.declare_queue("modified", durable=True, arguments={"qpid.max_count": 100})
            await ssn.modify_queue("modified", {"qpid.flow_stop_count": 50, "qpid.flow_resume_count": 10})
            await ssn.declare_queue("transient", arguments={"qpid.max_count": 10})
            before = {name: {k: (await ssn.query_queue(name))[k] for k in THRESHOLD_KEYS}
                      for name in ("orders", "ring", "modified")}
    finally:
        d.kill()
    assert before["orders"]["flowResumeCount"] == 700  # resolved, not given: it must resolve again the same way
    assert before["modified"]["arguments"] == {"qpid.max_count": 100, "qpid.flow_stop_count": 50,
                                               "qpid.flow_resume_count": 10}
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            after = {name: {k: (await ssn.query_queue(name))[k] for k in THRESHOLD_KEYS}
                     for name in ("orders", "ring", "modified")}
            with pytest.raises(qflow.NotFound):
                await ssn.query_queue("transient")
            # The recovered queue works: flow control stops at the recovered threshold.
            sender = ssn.sender("modified", capacity=100)
            await sender.send_many([b"x"] * 51)
            assert (await ssn.query_queue("modified"))["flowStopped"]
    finally:
        d.stop()
    assert after == before
    assert "recovered 3 queues, 0 exchanges, 0 bindings from " in d.log()


async def test_durable_exchanges_and_bindings_between_durable_ones_survive(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_exchange("events", "topic", durable=True)
            await ssn.declare_exchange("scratch", "fanout")  # not durable
            await ssn.declare_queue("audit", durable=True)
            await ssn.declare_queue("tmp")  # not durable
            await ssn.bind("events", "audit", "invoice.#")
            await ssn.bind("events", "audit", "order.*")
            await ssn.bind("events", "tmp", "invoice.#")  # to a transient queue: not kept
            await ssn.bind("scratch", "audit")  # from a transient exchange: not kept
            await ssn.bind("amq.direct", "audit", "k")  # the built-in exchanges are durable
            await ssn.unbind("events", "audit", "order.*")  # removed: stays removed
            await ssn.bind("events", "audit", "order.*")
            await ssn.unbind("events", "audit", "order.*")
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        assert exchange_types(d) == {"events": "topic"}
        assert api(d, "GET", "/api/exchanges/events")[1]["durable"] is True
        assert bindings(d) == {("events", "audit", "invoice.#"), ("amq.direct", "audit", "k")}
        assert queue_names(d) == {"audit"}
        async with qflow.open_connection("127.0.0.1", d.port) as conn:  # the recovered binding routes
            ssn = await conn.session()
            sender = ssn.sender("events/invoice.paid", capacity=1)
            await sender.send(b"paid")
            await sender.sync()
            receiver = await ssn.receiver("audit")
            assert (await receiver.fetch(timeout=TIMEOUT)).body == b"paid"
    finally:
        d.stop()
    assert "recovered 1 queues, 1 exchanges, 2 bindings from " in d.log()


async def test_deletes_survive_a_restart(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_exchange("gone", "direct", durable=True)
            await ssn.declare_exchange("kept", "direct", durable=True)
            await ssn.declare_queue("dropped", durable=True)
            await ssn.declare_queue("again", durable=True, arguments={"qpid.max_count": 10})
            await ssn.bind("gone", "again", "k")
            await ssn.bind("kept", "dropped", "k")
            await ssn.delete_queue("dropped")  # and its binding from "kept"
            await ssn.delete_exchange("gone")  # and its binding to "again"
            await ssn.delete_queue("again")
            await ssn.declare_queue("again", durable=True, arguments={"qpid.max_count": 20})
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {"again"}
        assert api(d, "GET", "/api/queues/again")[1]["arguments"] == {"qpid.max_count": 20}
        assert exchange_types(d) == {"kept": "direct"}
        assert bindings(d) == set()
    finally:
        d.stop()


def test_the_management_api_and_qflow_config_declare_durably(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        assert api(d, "PUT", "/api/queues/api-q", {"durable": True, "arguments": {"qpid.max_count": 500}})[0] == 201
        assert api(d, "PATCH", "/api/queues/api-q", {"arguments": {"qpid.flow_stop_count": 450}})[0] == 200
        assert api(d, "PUT", "/api/queues/api-tmp", {"arguments": {}})[0] == 201
        assert api(d, "PUT", "/api/exchanges/api-x", {"type": "fanout", "durable": True})[0] == 201
        assert api(d, "POST", "/api/bindings", {"exchange": "api-x", "queue": "api-q"})[0] == 201
        tool = [sys.executable, "-m", "qflow.cli.qflow_config", "-b", f"127.0.0.1:{d.port}"]
        for args in (["add", "queue", "tool-q", "--durable", "--max-queue-count", "300", "--flow-stop-count", "200",
                      "--flow-resume-count", "100"],
                     ["add", "exchange", "topic", "tool-x", "--durable"],
                     ["bind", "tool-x", "tool-q", "a.#"],
                     ["add", "queue", "tool-del", "--durable"],
                     ["del", "queue", "tool-del"]):
            done = subprocess.run(tool + args, capture_output=True, text=True, timeout=TIMEOUT)
            assert done.returncode == 0, (args, done.stderr)
        before = {name: api(d, "GET", f"/api/queues/{name}")[1] for name in ("api-q", "tool-q")}
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {"api-q", "tool-q"}
        for name, view in before.items():
            now = api(d, "GET", f"/api/queues/{name}")[1]
            assert {k: now[k] for k in THRESHOLD_KEYS} == {k: view[k] for k in THRESHOLD_KEYS}
        assert exchange_types(d) == {"api-x": "fanout", "tool-x": "topic"}
        assert bindings(d) == {("api-x", "api-q", ""), ("tool-x", "tool-q", "a.#")}
        # Declaring what was recovered, the same way, is a no-op (200), not a conflict.
        assert api(d, "PUT", "/api/queues/api-q", {"durable": True, "arguments": before["api-q"]["arguments"]})[0] == 200
    finally:
        d.stop()


async def test_exclusive_and_auto_delete_durable_queues(data_dir: Path) -> None:
    """As qpidd: exclusivity is not kept (its owner is gone), auto-delete is;
    a clean stop records no deletion the shutdown itself causes."""
    d = qflowd(data_dir)
    try:
        with pytest.raises(qflow.ConnectionClosed):
            async with qflow.open_connection("127.0.0.1", d.port) as conn:
                ssn = await conn.session()
                await ssn.declare_queue("mine", durable=True, exclusive=True)
                await ssn.declare_queue("auto", durable=True, auto_delete=True)
                await ssn.receiver("auto")
                async with qflow.open_connection("127.0.0.1", d.port) as other:
                    await (await other.session()).declare_queue("owner-left", durable=True, exclusive=True)
                # Its owner gone while the broker runs: deleted, and that is recorded (the restart below).
                with trio.fail_after(TIMEOUT):
                    while "owner-left" in queue_names(d):
                        await trio.sleep(0.05)
                d.proc.terminate()  # a clean stop while "mine"'s owner and "auto"'s consumer are still there
                assert d.proc.wait(timeout=TIMEOUT) == 0
                await ssn.sync()
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {"mine", "auto"}
        view = api(d, "GET", "/api/queues/mine")[1]
        assert (view["exclusive"], view["durable"]) == (False, True)
        assert api(d, "GET", "/api/queues/auto")[1]["autoDelete"] is True
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("mine", durable=True)  # anyone may use it now
            receiver = await ssn.receiver("auto")
            await receiver.close()  # its last consumer goes: auto-deleted, and that is recorded
            await ssn.sync()
            assert queue_names(d) == {"mine"}
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {"mine"}
    finally:
        d.stop()


async def test_the_log_is_compacted_while_changes_churn(data_dir: Path) -> None:
    """Declaring and deleting durable queues without end must not grow the log
    without end: once dead records dominate it is rewritten with the live ones."""
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("keep", durable=True, arguments={"qpid.max_count": 7})
            for i in range(700):
                await ssn.declare_queue(f"churn-{i}", durable=True)
                await ssn.delete_queue(f"churn-{i}")
        one_pair = len(frame(["queue", "churn-100", False, {}])) + len(frame(["queue-deleted", "churn-100"]))
        assert (data_dir / CONFIG_NAME).stat().st_size < 700 * one_pair // 2
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {"keep"}
        assert api(d, "GET", "/api/queues/keep")[1]["arguments"] == {"qpid.max_count": 7}
    finally:
        d.stop()


# -- damage ---------------------------------------------------------------------------------------------------
def _declare(d: Daemon, *names: str) -> None:
    for name in names:
        assert api(d, "PUT", f"/api/queues/{name}", {"durable": True})[0] == 201


def test_a_torn_last_record_is_dropped_and_everything_before_it_kept(data_dir: Path) -> None:
    d = qflowd(data_dir)
    _declare(d, "a", "b")
    d.kill()
    log_path = data_dir / CONFIG_NAME
    good = log_path.stat().st_size
    torn = frame(["queue", "c", False, {}])[:-3]  # a crash in the middle of writing "c"
    with open(log_path, "ab") as f:
        f.write(torn)
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {"a", "b"}
        _declare(d, "d")  # appended after the good records, not after the torn one
    finally:
        d.kill()
    log = d.log()
    assert f"{log_path}: the record at offset {good} is bad (record of {len(torn) - 8 + 3} bytes, only " \
           f"{len(torn) - 8} left (torn write))" in log
    assert f"kept the 3 records before it, dropped the {len(torn)} bytes" in log  # the header, a and b
    damaged = list(data_dir.glob(CONFIG_NAME + ".damaged-*"))
    assert len(damaged) == 1 and damaged[0].read_bytes().endswith(torn)
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {"a", "b", "d"}
    finally:
        d.stop()


def test_a_corrupt_record_in_the_middle_ends_recovery_there(data_dir: Path) -> None:
    d = qflowd(data_dir)
    _declare(d, "a")
    d.kill()
    log_path = data_dir / CONFIG_NAME
    offset = log_path.stat().st_size
    d = qflowd(data_dir)
    _declare(d, "b", "c")
    d.kill()
    data = bytearray(log_path.read_bytes())
    data[offset + 10] ^= 0xFF  # inside "b"'s payload
    log_path.write_bytes(bytes(data))
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {"a"}  # "c" was written after the bad record: dropped with it
    finally:
        d.stop()
    length = int.from_bytes(data[offset:offset + 4], "little")
    assert f"the record at offset {offset} is bad (crc32 mismatch over {length} bytes): kept the 2 records before " \
           f"it, dropped the {len(data) - offset} bytes" in d.log()


def test_a_file_that_is_not_a_configuration_log_is_refused(data_dir: Path) -> None:
    data_dir.mkdir()
    (data_dir / CONFIG_NAME).write_bytes(b"important: not ours\n")
    done = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", "--data-dir", str(data_dir)],
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 1
    assert f"qflowd: {data_dir / CONFIG_NAME} is not a qflow configuration log" in done.stderr.splitlines()[-1]
    assert (data_dir / CONFIG_NAME).read_bytes() == b"important: not ours\n"  # left as it was


def test_a_recovered_queue_the_broker_now_refuses_stops_the_start(data_dir: Path) -> None:
    """Flow thresholds resolve against the broker's options: a queue valid under
    the old ones may be refused under new ones. qflowd then names it rather than
    drop a durable queue."""
    d = qflowd(data_dir)
    _declare(d, "ok")
    assert api(d, "PUT", "/api/queues/big", {"durable": True, "arguments": {
        "qpid.flow_stop_size": 50_000_000, "qpid.flow_resume_size": 40_000_000}})[0] == 201
    d.stop()
    done = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", "--data-dir", str(data_dir),
                           "--default-queue-limit", "10000000"], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 1
    last = done.stderr.splitlines()[-1]
    assert last.startswith(f"qflowd: cannot recover queue 'big' from {data_dir / CONFIG_NAME}: "), last
    assert "qpid.flow_stop_size" in last
    d = qflowd(data_dir)  # under the old options it starts, and nothing was lost
    try:
        assert queue_names(d) == {"ok", "big"}
    finally:
        d.stop()


async def test_a_store_that_cannot_write_refuses_the_change_and_the_broker_is_unharmed(data_dir: Path) -> None:
    auto = "auto-" + "a" * 100  # its deletion's record cannot fit in what the limit leaves either
    d = start("--data-dir", str(data_dir))  # no log file: the file-size limit below would cut it too
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue(auto, durable=True, auto_delete=True)
            auto_receiver = await (await conn.session()).receiver(auto)
            # A soft limit on the size of any file qflowd writes: writes past it fail with EFBIG.
            size = (data_dir / CONFIG_NAME).stat().st_size
            resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (size + 200, resource.RLIM_INFINITY))
            kept = []
            with pytest.raises(qflow.ResourceLimitExceeded) as refused:
                for i in range(20):
                    await ssn.declare_queue(f"q{i}", durable=True, arguments={"x-pad": "p" * 40})
                    kept.append(f"q{i}")
            failed = f"q{len(kept)}"
            assert kept and f"queue.declare {failed!r}: refused, the store could not write it to " in str(refused.value)
            ssn = await conn.session()
            with pytest.raises(qflow.NotFound):
                await ssn.query_queue(failed)  # not declared
            await ssn.declare_queue("transient")  # non-durable work goes on
            long_name = "x" * 100  # its record cannot fit in what the limit leaves
            status, body = api(d, "PUT", f"/api/exchanges/{long_name}", {"type": "direct", "durable": True})
            assert status == 409 and "could not write it" in body["error"]
            assert long_name not in exchange_types(d)
            # A deletion the broker makes by itself cannot be refused: it happens, unrecorded.
            await auto_receiver.close()
            assert auto not in queue_names(d)
            resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            await ssn.declare_queue("after", durable=True)  # the cut-off record left nothing behind
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        assert queue_names(d) == {*kept, "after", auto}  # the unrecorded deletion is undone by the restart
    finally:
        d.stop()
    assert "is bad" not in d.log()


def test_the_lock_file_names_the_holder_only_while_it_lives(data_dir: Path) -> None:
    """The PID in the lock file is information, never the lock: a dead holder's
    PID left in it does not stop a start."""
    data_dir.mkdir(mode=0o700)
    (data_dir / "lock").write_text(f"{os.getpid()}\n")  # a live process, but it holds no lock
    d = qflowd(data_dir)
    d.stop()
