"""Closing a client's connection from the tools and the API: qflow-config close-connection PEER and
DELETE /api/connections/PEER close it with connection.close 320 naming who closed it; the broker logs
the change and the close; its unaccepted deliveries go back. (The console's button: test_console.py.)"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import quote

import pytest
import trio

import qflow
from qflow.protocol import spec as P
from tests.conftest import Daemon
from tests.test_tools import config

DEADLINE = 60


def request(d: Daemon, method: str, path: str) -> tuple[int, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}{path}", method=method,
                                 headers={"Content-Type": "application/json"})  # the request guard asks it
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


async def _closed_by(d: Daemon, close: Any, name: str) -> qflow.ConnectionClosed:
    """A client with an unaccepted delivery, closed by ``close(peer)``; the error its calls then raise."""
    async with qflow.open_connection("127.0.0.1", d.port, name=name) as conn:
        ssn = await conn.session()
        await ssn.declare_queue(name)
        sender = ssn.sender(name)
        await sender.send(b"kept")
        await sender.sync()
        receiver = await ssn.receiver(name, accept="explicit")
        await receiver.fetch(timeout=DEADLINE)
        (peer,) = [c["peer"] for c in request(d, "GET", "/api/connections")[1] if c["name"] == name]
        await trio.to_thread.run_sync(close, peer)
        with trio.fail_after(DEADLINE), pytest.raises(qflow.ConnectionClosed) as info:
            while True:
                await ssn.query_queue(name)
                await trio.sleep(0.01)
    return info.value


async def test_delete_on_the_api_closes_the_connection(daemon: Daemon) -> None:
    def close(peer: str) -> None:
        assert request(daemon, "DELETE", "/api/connections/" + quote(peer, safe="")) == (
            200, {"connection": peer, "closed": True})

    error = await _closed_by(daemon, close, "api-closed")
    assert error.code == P.CONNECTION_FORCED
    assert "closed by an operator (user 'anonymous', management API)" in error.text
    q = request(daemon, "GET", "/api/queues/api-closed")[1]
    assert (q["msgDepth"], q["msgTotalDequeues"]) == (1, 0)  # the unaccepted delivery went back
    log = daemon.log()
    assert "DELETE /api/connections/" in log and "closed: name 'api-closed', user 'anonymous': closed by an " \
        "operator" in log
    status, body = request(daemon, "DELETE", "/api/connections/127.0.0.1:1")
    assert status == 404 and "connection '127.0.0.1:1' not found" in body["error"]


async def test_qflow_config_close_connection(daemon: Daemon) -> None:
    def close(peer: str) -> None:
        done = config(daemon, "close-connection", peer)
        assert done.returncode == 0 and done.stdout == "", done.stderr

    error = await _closed_by(daemon, close, "tool-closed")
    assert error.code == P.CONNECTION_FORCED and "closed by an operator" in error.text
    missing = config(daemon, "close-connection", "127.0.0.1:1")
    assert missing.returncode == 1 and "not found" in missing.stderr
