"""Arguments another broker acts on and qflow does not implement are refused, never ignored:
by the protocol's declare and modify, the management API, qflow-config, and in the
list docs/operators.md gives; a durable queue declared with one before still recovers.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import qflow
from qflow.broker.arguments import (
    EXCHANGE_ARGUMENTS,
    EXCHANGE_IMPLEMENTED,
    QUEUE_ARGUMENTS,
    QUEUE_IMPLEMENTED,
    refuse_unsupported,
    unsupported,
)
from qflow.protocol import CommandError
from qflow.protocol.spec import INVALID_ARGUMENT
from qflow.store.definitions import CONFIG_NAME, frame
from qflow.testing import Daemon, start
from tests.conftest import Running
from tests.test_tools import config

OPERATORS = Path(__file__).resolve().parent.parent / "docs" / "operators.md"
TIMEOUT = 60


def api(d: Daemon, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("key", sorted(QUEUE_ARGUMENTS))
def test_each_listed_queue_argument_is_refused_naming_it(key: str) -> None:
    with pytest.raises(CommandError) as caught:
        refuse_unsupported("queue.declare 'q'", "queue", {key: "on", "x-team": "billing"})
    assert caught.value.code == INVALID_ARGUMENT
    assert f"queue argument {key!r}" in caught.value.text
    assert "is not supported by qflow" in caught.value.text
    assert "x-team" not in caught.value.text


@pytest.mark.parametrize("key", sorted(EXCHANGE_ARGUMENTS))
def test_each_listed_exchange_argument_is_refused_naming_it(key: str) -> None:
    assert unsupported("exchange", {key: "x"}) == [
        f"exchange argument {key!r} ({EXCHANGE_ARGUMENTS[key].broker}: {EXCHANGE_ARGUMENTS[key].meaning}) is not "
        "supported by qflow"]


def test_implemented_free_form_and_harmless_arguments_pass() -> None:
    assert not set(QUEUE_IMPLEMENTED) & set(QUEUE_ARGUMENTS)
    assert unsupported("queue", {key: 1 for key in QUEUE_IMPLEMENTED}) == []
    assert unsupported("queue", {"x-team": "billing", "x-retries": 3, "color": "red"}) == []
    assert unsupported("queue", {"x-queue-type": "classic", "qpid.priorities": 0,
                                 "x-single-active-consumer": False}) == []
    # Only the harmless value itself: a True is not taken for 1 nor a 0 for False.
    assert len(unsupported("queue", {"x-queue-type": "quorum", "qpid.fairshare": False,
                                     "x-single-active-consumer": 0})) == 3


def test_qpidd_fairshare_keys_are_refused_by_prefix() -> None:
    assert unsupported("queue", {"qpid.fairshare-3": 5, "x-qpid-fairshare-1": 2}) != []
    assert len(unsupported("queue", {"qpid.fairshare-3": 5, "x-qpid-fairshare-1": 2})) == 2


def test_the_refusal_says_what_qflow_offers_instead() -> None:
    [reason] = unsupported("queue", {"x-max-length": 10})
    assert "RabbitMQ" in reason and "qpid.max_count" in reason
    # Implemented now: the queue's default ttl, dead-lettering, priorities, an exchange's alternate.
    assert unsupported("queue", {"x-message-ttl": 500, "x-dead-letter-exchange": "dlx",
                                 "x-dead-letter-routing-key": "dead", "alternate-exchange": "dlx",
                                 "qpid.priorities": 10, "x-qpid-priorities": 10, "x-max-priority": 10}) == []
    assert unsupported("exchange", {"alternate-exchange": "dlx"}) == []


async def test_declare_and_modify_refuse_them_and_the_session_carries_on(running: Running) -> None:
    async with qflow.open_connection(running.host, running.port) as conn:
        ssn = await conn.session()
        with pytest.raises(qflow.InvalidArgument) as caught:
            await ssn.declare_queue("ttl", arguments={"x-expires": 500, "x-team": "billing"})
        assert "'x-expires'" in str(caught.value) and "not supported by qflow" in str(caught.value)
        assert "ttl" not in running.broker.queues
        ssn = await conn.session()
        await ssn.declare_queue("q", arguments={"x-team": "billing"})
        with pytest.raises(qflow.InvalidArgument, match="'qpid.last_value_queue_key'"):
            await ssn.modify_queue("q", {"qpid.last_value_queue_key": "sym"})
        assert running.broker.queues["q"].arguments == {"x-team": "billing"}
        ssn = await conn.session()
        # Redeclaring an existing queue with one is refused too: nothing is accepted that is ignored.
        with pytest.raises(qflow.InvalidArgument, match="'x-dead-letter-strategy'"):
            await ssn.declare_queue("q", arguments={"x-dead-letter-strategy": "at-least-once"})


@pytest.fixture(scope="module")
def qflowd() -> Daemon:
    d = start()
    yield d
    d.stop()


def test_the_api_refuses_them_for_queues_and_exchanges(qflowd: Daemon) -> None:
    status, body = api(qflowd, "PUT", "/api/queues/api-ttl", {"arguments": {"x-expires": 1000}})
    assert status == 400 and "'x-expires'" in body["error"] and "not supported by qflow" in body["error"]
    assert api(qflowd, "GET", "/api/queues/api-ttl")[0] == 404
    assert api(qflowd, "PUT", "/api/queues/api-q", {"arguments": {"x-team": "ops"}})[0] == 201
    status, body = api(qflowd, "PATCH", "/api/queues/api-q", {"arguments": {"x-expires": 60000}})
    assert status == 400 and "'x-expires'" in body["error"]
    assert api(qflowd, "GET", "/api/queues/api-q")[1]["arguments"] == {"x-team": "ops"}
    status, body = api(qflowd, "PUT", "/api/exchanges/api-x", {"type": "direct", "arguments": {"qpid.ive": 1}})
    assert status == 400 and "exchange argument 'qpid.ive'" in body["error"]
    assert api(qflowd, "GET", "/api/exchanges/api-x")[0] == 404
    status, body = api(qflowd, "PUT", "/api/exchanges/api-x", {"type": "direct",
                                                               "arguments": {"alternate-exchange": 5}})
    assert status == 400 and "alternate-exchange must be an exchange's name, not 5" in body["error"]
    # Labels and the alternate exchange are kept and shown.
    arguments = {"x-team": "ops", "alternate-exchange": "dlx"}
    assert api(qflowd, "PUT", "/api/exchanges/api-x", {"type": "direct", "arguments": arguments})[0] == 201
    assert api(qflowd, "GET", "/api/exchanges/api-x")[1]["arguments"] == arguments


def test_qflow_config_refuses_them(qflowd: Daemon) -> None:
    done = config(qflowd, "add", "queue", "cfg-ttl", "--argument", "x-expires=1000")
    assert done.returncode != 0
    assert "'x-expires'" in done.stderr and "not supported by qflow" in done.stderr
    assert api(qflowd, "GET", "/api/queues/cfg-ttl")[0] == 404
    done = config(qflowd, "add", "exchange", "direct", "cfg-x", "--argument", "qpid.ive=1")
    assert done.returncode != 0 and "'qpid.ive'" in done.stderr
    done = config(qflowd, "add", "queue", "cfg-q", "--argument", "x-team=billing")
    assert done.returncode == 0, done.stderr
    done = config(qflowd, "modify", "queue", "cfg-q", "--argument", "qpid.last_value_queue_key=sym")
    assert done.returncode != 0 and "'qpid.last_value_queue_key'" in done.stderr


def test_a_durable_queue_declared_with_one_before_still_recovers_with_a_warning(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    d = start("--data-dir", str(data_dir), log=str(tmp_path / "first.log"))
    assert api(d, "PUT", "/api/queues/kept", {"durable": True})[0] == 201
    d.stop()
    with open(data_dir / CONFIG_NAME, "ab") as f:  # as a qflowd before the refusal would have written it
        f.write(frame(["queue", "old-ttl", False, {"x-expires": 500, "qpid.max_count": 10}]))
    d = start("--data-dir", str(data_dir), log=str(tmp_path / "second.log"))
    try:
        status, view = api(d, "GET", "/api/queues/old-ttl")
        assert status == 200 and view["arguments"] == {"x-expires": 500, "qpid.max_count": 10}
        # Changing something else works; the old argument is not in the change, so it is not refused.
        assert api(d, "PATCH", "/api/queues/old-ttl", {"arguments": {"qpid.max_count": 20}})[0] == 200
    finally:
        d.stop()
    assert re.search(r"WARNING .*recovered queue 'old-ttl': queue argument 'x-expires' .* is not supported "
                     r"by qflow.*, and has no effect", d.log())


def test_operators_md_lists_both_sets() -> None:
    text = OPERATORS.read_text()
    for key in (*QUEUE_IMPLEMENTED, *QUEUE_ARGUMENTS, *EXCHANGE_IMPLEMENTED, *EXCHANGE_ARGUMENTS):
        assert f"`{key}`" in text, key
