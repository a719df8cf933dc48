"""What qflowd logs for an operator: its start and stop, each connection
opened and closed (address, name, user), and each management change (who,
what, done or refused), at info; ``--log-format json``; and the level changed
while it runs (``qflow-config log-level``, ``PUT /api/broker/log-level``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import qflow
from qflow.testing import Daemon, start

BIN = Path(sys.executable).parent
DEADLINE = 60.0


def tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "qflow-config"), *args], capture_output=True, text=True, timeout=DEADLINE,
                          stdin=subprocess.DEVNULL)


def wait_for_log(d: Daemon, text: str) -> list[dict]:
    """The JSON log's records, once one has ``text`` in its message (the log is written as things happen)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        records = [json.loads(line) for line in d.log().splitlines() if line.strip()]
        if any(text in r["message"] for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)  # polling a file for an event, not a synchronisation by sleeping


def messages(records: list[dict], level: str = "info") -> list[str]:
    return [r["message"] for r in records if r["level"] == level]


@pytest.mark.native_only
async def test_operator_log_in_json(tmp_path: Path) -> None:
    d = start("--no-data-dir", "--log-format", "json", log=str(tmp_path / "qflowd.log"))
    try:
        b = f"127.0.0.1:{d.port}"
        records = wait_for_log(d, "started")
        assert all(set(r) >= {"time", "level", "logger", "message"} for r in records)
        assert any(m.startswith("qflowd ") and f"port {d.port}" in m for m in messages(records))

        async with qflow.open_connection("127.0.0.1", d.port, name="audited") as conn:
            await conn.session()
        records = wait_for_log(d, "name 'audited', user 'anonymous': closed by the client")
        info = messages(records)
        assert any("opened: name 'audited', user 'anonymous'" in m and "127.0.0.1:" in m for m in info)
        assert any("closed: name 'audited', user 'anonymous': closed by the client" in m for m in info)

        assert tool("-b", b, "add", "queue", "audited", "--max-queue-count", "9").returncode == 0
        assert tool("-b", b, "add", "queue", "audited", "--durable").returncode == 1  # refused: logged too
        assert tool("-b", b, "purge", "queue", "audited").returncode == 0
        assert tool("-b", b, "del", "queue", "audited").returncode == 0
        info = messages(wait_for_log(d, "DELETE /api/queues/audited"))
        changes = [m for m in info if m.startswith("management change by 127.0.0.1:")]
        assert any("PUT /api/queues/audited done (201)" in m and "qpid.max_count" in m for m in changes)
        assert any("PUT /api/queues/audited refused (409)" in m and "already exists" in m for m in changes)
        assert any("POST /api/queues/audited/purge done (200)" in m for m in changes)
        assert any("DELETE /api/queues/audited" in m and "done (200)" in m for m in changes)
    finally:
        d.stop()
    assert d.proc.returncode == 0
    info = messages([json.loads(line) for line in d.log().splitlines()])
    assert any(m.startswith("qflowd stopping on SIGTERM") for m in info)
    assert info[-1].startswith("qflowd stopped")


@pytest.mark.native_only
def test_log_level_changed_at_run_time(tmp_path: Path) -> None:
    d = start("--no-data-dir", "--log-level", "warning", log=str(tmp_path / "qflowd.log"))
    try:
        b = f"127.0.0.1:{d.port}"
        level = tool("-b", b, "log-level")
        assert level.returncode == 0 and level.stdout == "warning\n"
        assert tool("-b", b, "add", "queue", "quiet").returncode == 0
        assert "management change" not in d.log()  # info is below warning
        assert tool("-b", b, "log-level", "info").returncode == 0
        assert tool("-b", b, "log-level").stdout == "info\n"
        assert tool("-b", b, "del", "queue", "quiet").returncode == 0
        deadline = time.monotonic() + DEADLINE
        while "DELETE /api/queues/quiet" not in d.log() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "DELETE /api/queues/quiet" in d.log()
        refused = tool("-b", b, "log-level", "loud")
        assert refused.returncode == 1 and "must be one of debug, info, warning, error" in refused.stderr
        with pytest.raises(urllib.error.HTTPError) as info:
            request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}/api/broker/log-level",
                                             data=b'{"level": 3}', method="PUT",
                                             headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=DEADLINE)
        assert info.value.code == 400
    finally:
        d.stop()


@pytest.mark.native_only
async def test_changes_over_the_protocol_in_the_change_log(tmp_path: Path) -> None:
    """A client's declare, modify, bind, unbind, purge and delete are in the same
    change log as the API's, with who asked (connection address, user), once per
    command whatever the messages; a passive declare (a look) is not a change."""
    d = start("--no-data-dir", "--log-format", "json", log=str(tmp_path / "qflowd.log"))
    try:
        async with qflow.open_connection("127.0.0.1", d.port, name="changer") as conn:
            ssn = await conn.session()
            await ssn.declare_queue("audited", durable=False, arguments={"qpid.max_count": 500})
            await ssn.declare_queue("audited", arguments={"qpid.max_count": 500})  # exists: said so
            await ssn.declare_queue("audited", passive=True)
            await ssn.modify_queue("audited", {"qpid.max_count": 600})
            await ssn.declare_exchange("audit-x", "topic")
            await ssn.bind("audit-x", "audited", "a.#")
            sender = ssn.sender("audit-x/a.b", capacity=50)
            await sender.send_many([b"m"] * 200)
            await sender.sync()
            await ssn.unbind("audit-x", "audited", "a.#")
            await ssn.purge_queue("audited")
            await ssn.delete_exchange("audit-x")
            with pytest.raises(qflow.NotFound):
                await ssn.delete_queue("no such\nINFO forged line")
            ssn = await conn.session()
            await ssn.delete_queue("audited")
            await ssn.sync()
        records = wait_for_log(d, "queue.delete 'audited' done")
        changes = [m for m in messages(records) if m.startswith("management change by 127.0.0.1:")]
        who = "(user 'anonymous'): "
        expected = [
            who + "queue.declare 'audited' arguments {'qpid.max_count': 500} done (created)",
            who + "queue.declare 'audited' arguments {'qpid.max_count': 500} done (it existed already: nothing "
                  "changed)",
            who + "queue.modify 'audited' arguments {'qpid.max_count': 600} done",
            who + "exchange.declare 'audit-x' type topic done (created)",
            who + "exchange.bind 'audit-x' to queue 'audited' key 'a.#' done",
            who + "exchange.unbind 'audit-x' from queue 'audited' key 'a.#' done",
            who + "queue.purge 'audited' done (200 messages removed)",
            who + "exchange.delete 'audit-x' done",
            who + "queue.delete 'no such\\x0aINFO forged line' refused (404): queue.delete: queue 'no such\\\\nINFO "
                  "forged line' not found",  # the broker's text has repr's \\n: its backslash is doubled
            who + "queue.delete 'audited' done (0 messages removed)",
        ]
        assert [m.split(" ", 4)[4] for m in changes] == expected, changes
        # The same connection asked for every one of them: its address is the one the open was logged with.
        (opened,) = [m for m in messages(records) if "opened: name 'changer'" in m]
        peer = opened.split()[1]
        assert all(m.startswith(f"management change by {peer} ") for m in changes)
        assert not any("forged" in m and "\n" in m for m in messages(records))
    finally:
        d.stop()
