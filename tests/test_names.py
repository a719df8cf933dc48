"""Names and logs (issue 16):

> Queue, exchange and user names with control characters are refused.
> Everything logged that a client chose is escaped.

and the bug it fixes: "A queue name containing a newline forges a complete
ERROR line in the broker's log". A name is 1 to 255 bytes of UTF-8 without a
control character (qflow.protocol.names), refused on the messaging protocol
(a session error naming the field) and by the management API (400 naming
it); names recovered from older data stay usable; every client-chosen string
in a log line is escaped (``printable``). Checked against real qflowd
processes, their logs and the real tools.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import trio

import qflow
from qflow.client.errors import InvalidArgument
from qflow.protocol.names import MAX_NAME, check_name, name_problem, printable
from qflow.protocol.spec import CommandError
from qflow.store.definitions import DefinitionStore
from qflow.testing import Daemon
from tests.conftest import start_qflowd
from tests.test_tools import config, ok, queue, refused

TIMEOUT = 60
FORGED = "2026-01-01 00:00:00,000 ERROR qflow: FORGED the broker is compromised"


# -- the rule as a unit -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["orders", "a/b", "with space", "ünïcødé", "x" * MAX_NAME, "é" * 127, "tab-free",
                                  'quo"te\\back', "emoji 📨"])
def test_good_names(name: str) -> None:
    assert name_problem(name) is None
    check_name("queue.declare", "queue", name)


@pytest.mark.parametrize(("name", "problem"), [
    ("", "1 to 255 bytes, got 0"),
    ("x" * 256, "1 to 255 bytes, got 256"),
    ("é" * 128, "1 to 255 bytes, got 256"),
    ("new\nline", "control characters (\\x0a at position 3)"),
    ("\rcarriage", "control characters (\\x0d at position 0)"),
    ("tab\there", "control characters (\\x09 at position 3)"),
    ("nul\x00", "control characters (\\x00 at position 3)"),
    ("esc\x1b[2J", "control characters (\\x1b at position 3)"),
    ("del\x7f", "control characters (\\x7f at position 3)"),
    ("c1\x85", "control characters (\\x85 at position 2)"),
])
def test_bad_names_are_refused_naming_the_field(name: str, problem: str) -> None:
    assert problem in (name_problem(name) or "")
    with pytest.raises(CommandError) as err:
        check_name("exchange.declare", "exchange", name)
    assert err.value.text.startswith("exchange.declare: field 'exchange': ")


@pytest.mark.parametrize(("text", "logged"), [
    ("plain", "plain"),
    ("new\nline", "new\\x0aline"),
    ("cr\rlf\n", "cr\\x0dlf\\x0a"),
    ("esc\x1b[31mred", "esc\\x1b[31mred"),
    ("back\\x0aslash", "back\\\\x0aslash"),  # a literal backslash cannot pass for an escape
    ("line\u2028sep", "line\\u2028sep"),
    ("ünïcødé ok", "ünïcødé ok"),
])
def test_printable_escapes_what_could_break_a_log_line(text: str, logged: str) -> None:
    assert printable(text) == logged
    assert "\n" not in printable(text) and "\r" not in printable(text)


# -- the messaging protocol, a real qflowd ------------------------------------------------


async def test_the_protocol_refuses_bad_names_and_the_broker_carries_on() -> None:
    d = start_qflowd("--no-data-dir")
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("kept")
            sender = ssn.sender("kept")
            for i in range(3):
                await sender.send(b"kept %d" % i)
            await sender.sync()
            forging = "x\n" + FORGED
            cases = [
                (ssn.declare_queue(forging), "queue.declare: field 'queue': a name must not contain control "
                                             "characters (\\x0a at position 1)"),
                (ssn.declare_queue("esc\x1b[2J", durable=True), "queue.declare: field 'queue': a name must not "
                                                               "contain control characters (\\x1b"),
                (ssn.declare_queue("x" * 256), "queue.declare: field 'queue': a name must be 1 to 255 bytes"),
                (ssn.declare_exchange("ex\r", "fanout"), "exchange.declare: field 'exchange': a name must not "
                                                         "contain control characters (\\x0d"),
            ]
            for call, text in cases:
                with pytest.raises(InvalidArgument) as err:
                    with trio.fail_after(TIMEOUT):
                        await call
                assert text in str(err.value)
            # The same session, and the broker, carry on; nothing was created, nothing lost.
            assert (await ssn.query_queue("kept"))["msgDepth"] == 3
            names = {q["name"] for q in json.loads(_get(d, "/api/queues"))}
            assert names == {"kept"}
            receiver = await ssn.receiver("kept")
            got = [(await receiver.fetch(timeout=TIMEOUT)).body for _ in range(3)]
            assert got == [b"kept 0", b"kept 1", b"kept 2"]
    finally:
        d.stop()
    # No refusal put the forged text at the start of a line of the broker's log.
    assert not [line for line in d.log().splitlines() if line.startswith(FORGED[:30])], d.log()


def _get(d: Daemon, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}{path}", timeout=TIMEOUT) as response:
        return response.read().decode()


@pytest.mark.native_only
def test_the_management_api_and_qflow_config_refuse_bad_names() -> None:
    d = start_qflowd("--mgmt-port", "0", "--no-data-dir")
    try:
        refused(config(d, "add", "queue", "bad\nname"), 1,
                "Failed: queue name 'bad\\nname': a name must not contain control characters (\\x0a at position 3)")
        refused(config(d, "add", "queue", "esc\x1b[2J", "--durable"), 1, "control characters (\\x1b at position 3)")
        refused(config(d, "add", "exchange", "fanout", "ex\x07"), 1,
                "Failed: exchange name 'ex\\x07': a name must not contain control characters")
        refused(config(d, "add", "queue", "y" * 256), 1, "a name must be 1 to 255 bytes, got 256")
        ok(config(d, "add", "queue", "fine name ünïcødé"))
        assert queue(d, "fine name ünïcødé")["name"] == "fine name ünïcødé"
        listing = ok(config(d, "queues"))
        assert "bad" not in listing and "esc" not in listing
    finally:
        d.stop()


# -- the log: a name chosen before the rule cannot forge a line ----------------------------


def _legacy_data_dir(root: Path, name: str) -> Path:
    """A data directory written before names were checked: a durable queue whose
    name forges a log line, with flow thresholds that make qflowd log its name."""
    data = root / "data"
    data.mkdir()
    store = DefinitionStore.open(data)
    store.declare_queue(name, True, False, {"qpid.flow_resume_count": 1})  # logged: resume without stop
    store.declare_queue("second" + name, True, False, {"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
    store.close()
    return data


async def test_a_newline_in_a_name_cannot_forge_a_log_line(tmp_path: Path) -> None:
    name = "legacy\n" + FORGED
    data = _legacy_data_dir(tmp_path, name)
    d = start_qflowd("--data-dir", str(data), "--log-level", "info")
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            # Names held already stay usable: declared again, sent to, flow-stopped (logged), read.
            await ssn.declare_queue("second" + name, durable=True, arguments={"qpid.flow_stop_count": 2,
                                                                            "qpid.flow_resume_count": 1})
            sender = ssn.sender("second" + name, capacity=10)
            for i in range(3):
                await sender.send(b"m%d" % i)
            with trio.fail_after(TIMEOUT):
                while "flow stopped" not in d.log():
                    await trio.sleep(0.05)
            with trio.fail_after(TIMEOUT):
                assert (await ssn.query_queue("second" + name))["msgDepth"] == 3
                assert (await ssn.purge_queue("second" + name))["messages"] == 3
                await sender.sync()  # the purge resumed the flow: the held transfers complete
                while "flow resumed" not in d.log():
                    await trio.sleep(0.05)
                # A new name of the same kind is refused.
                with pytest.raises(InvalidArgument):
                    await ssn.declare_queue("new\n" + FORGED)
    finally:
        d.stop()
    log = d.log()
    escaped = "\\x0a" + FORGED
    # The name was logged (so this test can fail), escaped, inside the broker's own lines ...
    assert f'queue "legacy{escaped}": qpid.flow_resume_count given without' in log
    assert f'queue "secondlegacy{escaped}": flow stopped' in log
    assert f'queue "secondlegacy{escaped}": flow resumed' in log
    # ... and no line of the log is the forged one.
    lines = log.splitlines()
    assert not [line for line in lines if line.startswith(FORGED[:30])], log
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ", line) for line in lines), log
