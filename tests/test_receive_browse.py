"""qflow-receive browses (--browse, or Qpid's address option ``{mode: browse}``) and prints
each message's headers (--print-headers), as qpid-receive does; its address options are
read as Qpid writes them, and those it does not take are refused, not ignored."""

from __future__ import annotations

import json
import urllib.request

import pytest
from qflow.cli._qpid_address import AddressOptionsError, parse_qpid_address

from tests.conftest import Daemon
from tests.test_tools import config, ok, run


def depth(d: Daemon, queue: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}/api/queues/{queue}", timeout=60) as response:
        return json.loads(response.read())["msgDepth"]


@pytest.mark.parametrize(("text", "parsed"), [
    ("orders", ("orders", {})),
    ("orders; {mode: browse}", ("orders", {"mode": "browse"})),
    ("orders;{mode:'browse'}", ("orders", {"mode": "browse"})),
    ("a;b", ("a;b", {})),
    ("q; {mode: browse, node: {type: queue, x-declare: {arguments: {'x-n': 1}}}, filter: [a, b]}",
     ("q", {"mode": "browse", "node": {"type": "queue", "x-declare": {"arguments": {"x-n": 1}}},
            "filter": ["a", "b"]})),
])
def test_qpid_addresses_parse(text: str, parsed: tuple) -> None:
    assert parse_qpid_address(text) == parsed


@pytest.mark.parametrize(("text", "error"), [
    ("q; {mode browse}", "expected ':'"),
    ("q; {mode: browse", "do not end with '}'"),
    ("q; {mode: browse}}", "unexpected '}'"),
])
def test_bad_address_options_are_refused_saying_where(text: str, error: str) -> None:
    with pytest.raises(AddressOptionsError, match=error):
        parse_qpid_address(text)


def test_browse_leaves_the_messages_and_print_headers_shows_them(daemon: Daemon) -> None:
    b = f"127.0.0.1:{daemon.port}"
    ok(config(daemon, "add", "queue", "peeked"))
    ok(run("qflow-send", "-b", b, "-a", "peeked", "--messages", "2", "--content-string", "look", "--durable"))
    for args in (["-a", "peeked", "--browse"], ["-a", "peeked; {mode: browse}"]):
        got = ok(run("qflow-receive", "-b", b, *args, "--timeout", "1"))
        assert got.splitlines() == ["look", "look"]
        assert depth(daemon, "peeked") == 2  # browsed: still there
    shown = ok(run("qflow-receive", "-b", b, "-a", "peeked", "--browse", "--print-headers", "--timeout", "1"))
    blocks = shown.split("look\n")
    assert blocks[-1] == "" and len(blocks) == 3, shown
    first = dict(line.split(": ", 1) for line in blocks[0].splitlines())
    assert first["RoutingKey"] == "peeked" and first["Durable"] == "true" and first["Sequence"].isdigit()
    assert json.loads(first["Properties"]) == {} and "Exchange" not in first  # the default exchange: ""
    # Consuming, with headers: printed, then removed.
    shown = ok(run("qflow-receive", "-b", b, "-a", "peeked", "--print-headers", "yes", "--timeout", "1"))
    assert shown.count("RoutingKey: peeked\n") == 2 and depth(daemon, "peeked") == 0


@pytest.mark.parametrize(("address", "error"), [
    ("q; {create: always}", "address option 'create' not supported (qflow-receive takes mode)"),
    ("q; {mode: peek}", "mode must be browse or consume, not 'peek'"),
    ("q; {mode: browse", "do not end with '}'"),
])
def test_address_options_it_does_not_take_are_refused(address: str, error: str) -> None:
    done = run("qflow-receive", "-b", "127.0.0.1:1", "-a", address)
    assert done.returncode == 2 and error in done.stderr, done.stderr
