"""The management HTTP API (qflow.management): the routes, their statuses and
JSON, the live view of held sessions, /metrics (and that it shows the JSON's
numbers), and a server that stays up under malformed, oversized and slow
requests.

Most tests serve the API in-process (a broker, its protocol server and the
management server in the test's nursery), speaking HTTP through h11 or raw
bytes; the last ones start a real qflowd.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import h11
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from qflow.broker.settings import FlowDefaults
from qflow.management import MAX_BODY, ManagementApi, ManagementServer
from qflow.management.metrics import BROKER_METRICS, QUEUE_METRICS
from tests.conftest import Running, start_broker, start_qflowd

# HTTP behaviour does not depend on the accounting implementation: run once.
pytestmark = pytest.mark.native_only

TIMEOUT = 2.0  # the management server's request deadline in these tests


@dataclass
class Mgmt:
    running: Running
    server: ManagementServer
    port: int

    async def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None
                      ) -> tuple[int, Any]:
        return await http(self.port, method, path, body, raw)


async def http(port: int, method: str, path: str, body: Any = None, raw: bytes | None = None,
               headers: list[tuple[str, str]] | None = None) -> tuple[int, Any]:
    """One well-formed request over a fresh connection: (status, decoded JSON or text)."""
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    conn = h11.Connection(h11.CLIENT)
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        given = headers if headers is not None else [("content-type", "application/json")]
        out = conn.send(h11.Request(method=method, target=path, headers=[
            ("host", "127.0.0.1"), ("content-length", str(len(data))), *given]))
        out += conn.send(h11.Data(data=data)) if data else b""
        out += conn.send(h11.EndOfMessage())
        await stream.send_all(out)
        return await _read_response(conn, stream)


async def _read_response(conn: h11.Connection, stream: trio.abc.Stream) -> tuple[int, Any]:
    status = 0
    content_type = ""
    body = b""
    with trio.fail_after(30):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            elif type(event) is h11.Response:
                status = event.status_code
                content_type = dict(event.headers).get(b"content-type", b"").decode()
            elif type(event) is h11.Data:
                body += event.data
            elif type(event) is h11.EndOfMessage:
                break
    if content_type.startswith("application/json"):
        return status, json.loads(body)
    return status, body.decode()


async def raw_exchange(port: int, data: bytes, *, shut: bool = False, wait: float = 30) -> bytes:
    """Send raw bytes and read until the server closes: what it answered."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    async with stream:
        try:
            await stream.send_all(data)
            if shut:
                await stream.send_eof()
        except trio.BrokenResourceError:
            pass
        with trio.fail_after(wait):
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                got += chunk
    return got


async def wait_idle(server: ManagementServer) -> None:
    """Every connection's task has ended (the server closes them a moment after the client)."""
    with trio.fail_after(30):
        while server.active:
            await trio.sleep(0.02)


def status_of(response: bytes) -> int:
    assert response.startswith(b"HTTP/1.1 "), response[:200]
    return int(response.split(b" ", 2)[1])


def error_of(response: bytes) -> str:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]


@pytest.fixture
async def mgmt(nursery: trio.Nursery) -> Mgmt:
    running = await start_broker(nursery)
    api = ManagementApi(running.broker, running.server, {"port": running.port})
    server = ManagementServer(api, timeout=TIMEOUT)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    return Mgmt(running, server, port)


# -- the API ------------------------------------------------------------------------


async def test_queue_declare_get_modify_purge_delete(mgmt: Mgmt) -> None:
    args = {"qpid.max_count": 10000, "qpid.max_size": 1000000, "x-custom": "kept"}
    assert (await mgmt.request("PUT", "/api/queues/orders", {"durable": True, "arguments": args}))[0] == 201
    status, q = await mgmt.request("GET", "/api/queues/orders")
    assert status == 200
    # Every QMF statistic the issue names, and the arguments exactly as declared.
    for key in ("name", "durable", "autoDelete", "exclusive", "arguments", "msgDepth", "byteDepth",
                "msgTotalEnqueues", "msgTotalDequeues", "byteTotalEnqueues", "byteTotalDequeues", "consumerCount",
                "bindingCount", "discardsRing", "discardsOverflow", "flowStopped", "flowStoppedCount",
                "flowStopCount", "flowResumeCount", "flowStopSize", "flowResumeSize", "heldTransfers"):
        assert key in q, key
    assert q["arguments"] == args and q["durable"] is True
    # Default ratios 80/70 of the declared limits.
    assert (q["flowStopCount"], q["flowResumeCount"], q["flowStopSize"], q["flowResumeSize"]) == (
        8000, 7000, 800000, 700000)

    # Same settings again: 200; different ones: 409 naming the difference.
    assert (await mgmt.request("PUT", "/api/queues/orders", {"durable": True, "arguments": args}))[0] == 200
    status, err = await mgmt.request("PUT", "/api/queues/orders", {"arguments": args})
    assert status == 409 and "durable" in err["error"]

    status, q = await mgmt.request("PATCH", "/api/queues/orders", {"arguments": {"qpid.flow_stop_count": 50,
                                                                                  "qpid.flow_resume_count": 40}})
    assert status == 200 and (q["flowStopCount"], q["flowResumeCount"]) == (50, 40)
    status, err = await mgmt.request("PATCH", "/api/queues/orders", {"arguments": {"qpid.flow_resume_count": 60}})
    # qpidd's text: the key, the value and the rule.
    assert status == 400 and "qpid.flow_resume_count=60 must be less than or equal to qpid.flow_stop_count=50" in (
        err["error"])

    conn = await mgmt.running.connect()
    ssn = await conn.session()
    sender = ssn.sender("orders")
    for i in range(3):
        await sender.send(f"m{i}")
    await sender.sync()
    status, err = await mgmt.request("DELETE", "/api/queues/orders?if_empty=true")
    assert status == 409 and "not empty" in err["error"]
    assert await mgmt.request("POST", "/api/queues/orders/purge") == (200, {"queue": "orders", "purged": 3})
    assert (await mgmt.request("GET", "/api/queues/orders"))[1]["msgTotalDequeues"] == 3
    status, body = await mgmt.request("DELETE", "/api/queues/orders?if_empty=true&if_unused=1")
    assert status == 200 and body["deleted"] is True
    assert (await mgmt.request("GET", "/api/queues/orders"))[0] == 404
    assert (await mgmt.request("DELETE", "/api/queues/orders"))[0] == 404
    await conn.close()


@pytest.mark.parametrize("name", ["a/b", "with space", "percent%25", "q?x=1#frag", "ünïcødé", 'quo"te\\back',
                                  "dots..", ".", "..", "x" * 255, "+plus"])
async def test_any_queue_name_is_addressable(mgmt: Mgmt, name: str) -> None:
    path = "/api/queues/" + quote(name, safe="")
    status, q = await mgmt.request("PUT", path, {})
    assert status == 201, q
    assert q["name"] == name
    assert (await mgmt.request("GET", path))[1]["name"] == name
    assert (await mgmt.request("POST", path + "/purge"))[0] == 200
    names = [q["name"] for q in (await mgmt.request("GET", "/api/queues"))[1]]
    assert names == [name]
    assert (await mgmt.request("DELETE", path))[0] == 200


async def test_exchanges_and_bindings(mgmt: Mgmt) -> None:
    await mgmt.request("PUT", "/api/queues/q1")
    assert (await mgmt.request("PUT", "/api/exchanges/events", {"type": "topic"}))[0] == 201
    assert (await mgmt.request("PUT", "/api/exchanges/events", {"type": "topic"}))[0] == 200
    status, err = await mgmt.request("PUT", "/api/exchanges/events", {"type": "fanout"})
    assert status == 409 and "topic" in err["error"]
    assert (await mgmt.request("PUT", "/api/exchanges/x", {"type": "bogus"}))[0] == 400
    assert (await mgmt.request("PUT", "/api/exchanges/amq.mine", {"type": "direct"}))[0] == 409
    names = [e["name"] for e in (await mgmt.request("GET", "/api/exchanges"))[1]]
    assert {"", "amq.direct", "amq.fanout", "amq.topic", "events"} <= set(names)

    binding = {"exchange": "events", "queue": "q1", "key": "a.#"}
    assert (await mgmt.request("POST", "/api/bindings", binding))[0] == 201
    assert (await mgmt.request("POST", "/api/bindings", binding))[0] == 200
    assert (await mgmt.request("GET", "/api/bindings"))[1] == [binding]
    assert (await mgmt.request("GET", "/api/queues/q1"))[1]["bindingCount"] == 2
    assert (await mgmt.request("POST", "/api/bindings", {**binding, "queue": "nope"}))[0] == 404
    status, err = await mgmt.request("DELETE", "/api/exchanges/events?if_unused=true")
    assert status == 409
    assert (await mgmt.request("DELETE", "/api/bindings", binding))[0] == 200
    assert (await mgmt.request("DELETE", "/api/bindings", binding))[0] == 404
    # The same through the query string, for clients that cannot send a DELETE body.
    await mgmt.request("POST", "/api/bindings", binding)
    assert (await mgmt.request("DELETE", "/api/bindings?exchange=events&queue=q1&key=a.%23"))[0] == 200
    assert (await mgmt.request("DELETE", "/api/exchanges/events"))[0] == 200
    assert (await mgmt.request("GET", "/api/exchanges/events"))[0] == 404
    assert (await mgmt.request("DELETE", "/api/exchanges/amq.direct"))[0] == 409


async def test_connections_show_held_sessions_and_since_when(mgmt: Mgmt) -> None:
    await mgmt.request("PUT", "/api/queues/slow", {"arguments": {"qpid.flow_stop_count": 5,
                                                                 "qpid.flow_resume_count": 2}})
    conn = await mgmt.running.connect(name="producer")
    ssn = await conn.session("ssn-1")
    sender = ssn.sender("slow", capacity=10)
    sent = 0

    async def produce() -> None:
        nonlocal sent
        for _ in range(30):
            await sender.send(b"x")
            sent += 1
        await sender.sync()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(produce)
            while True:  # 5 complete, then the sender's whole window of 10 is held
                _, conns = await mgmt.request("GET", "/api/connections")
                ssns = [s for c in conns for s in c["sessions"]]
                if ssns and ssns[0]["heldTransfers"] == 10:
                    break
                await trio.sleep(0.05)
            (c,) = conns
            assert c["name"] == "producer" and c["peer"].startswith("127.0.0.1:")
            (s,) = c["sessions"]
            assert s["name"] == "ssn-1" and s["senderCapacity"] == 10 and s["incompleteCommands"] == 10
            assert s["flowStopped"] is True
            (held,) = s["heldBy"]
            assert held["queue"] == "slow" and held["since"].endswith("Z") and held["heldSeconds"] >= 0
            _, q = await mgmt.request("GET", "/api/queues/slow")
            assert q["flowStopped"] is True and q["msgDepth"] == 15 and q["heldTransfers"] == 10
            _, broker = await mgmt.request("GET", "/api/broker")
            assert broker["totals"]["heldSessions"] == 1 and broker["totals"]["flowStoppedQueues"] == 1

            # Through the API: drop the count thresholds, which releases the held transfers (the size
            # unit keeps its thresholds pre-filled from the 100 MB default limit, far above these bytes).
            status, q = await mgmt.request("PATCH", "/api/queues/slow", {"arguments": {
                "qpid.flow_stop_count": 0, "qpid.flow_resume_count": 0}})
            assert status == 200 and q["flowStopped"] is False
    assert sent == 30
    _, conns = await mgmt.request("GET", "/api/connections")
    s = conns[0]["sessions"][0]
    assert (s["heldTransfers"], s["heldBy"], s["flowStopped"]) == (0, [], False)
    _, q = await mgmt.request("GET", "/api/queues/slow")
    assert q["flowStopped"] is False and q["flowStoppedCount"] == 1 and q["msgDepth"] == 30
    assert (await mgmt.request("POST", "/api/queues/slow/purge"))[1]["purged"] == 30
    await conn.close()


async def test_broker_view(mgmt: Mgmt) -> None:
    await mgmt.request("PUT", "/api/queues/a")
    status, b = await mgmt.request("GET", "/api/broker")
    assert status == 200 and b["version"] and b["uptimeSeconds"] >= 0
    assert b["options"]["defaultFlowStopThreshold"] == 80 and b["options"]["defaultFlowResumeThreshold"] == 70
    assert b["options"]["defaultQueueLimit"] == FlowDefaults().queue_limit
    assert b["options"]["accounting"] in ("native", "python")
    assert b["totals"]["queues"] == 1
    status, index = await mgmt.request("GET", "/api")
    assert status == 200 and any("/api/queues" in e for e in index["endpoints"])


async def test_metrics_parse_with_the_prometheus_parser(mgmt: Mgmt) -> None:
    weird = 'we"ird\\name\nq'
    await mgmt.request("PUT", "/api/queues/plain", {"arguments": {"qpid.flow_stop_count": 2,
                                                                  "qpid.flow_resume_count": 1}})
    # Clients can no longer create a name with a newline; one recovered from older data still needs escaping.
    mgmt.running.broker.declare_queue(weird)
    conn = await mgmt.running.connect()
    ssn = await conn.session()
    sender = ssn.sender("plain", capacity=5)
    for _ in range(4):
        await sender.send(b"12345")
    with trio.fail_after(30):
        while (await mgmt.request("GET", "/api/queues/plain"))[1]["heldTransfers"] < 2:
            await trio.sleep(0.05)
    status, text = await mgmt.request("GET", "/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    samples = {(s.name, s.labels.get("queue")): s.value for f in families.values() for s in f.samples}
    assert samples[("qflow_queue_depth_messages", "plain")] == 4
    assert samples[("qflow_queue_depth_bytes", "plain")] == 4 * 13  # "" 1, "plain" 6, nil 1, body 5
    assert samples[("qflow_queue_flow_stopped", "plain")] == 1
    assert samples[("qflow_queue_flow_stops_total", "plain")] == 1
    assert samples[("qflow_queue_held_transfers", "plain")] == 2
    assert samples[("qflow_queue_messages_enqueued_total", "plain")] == 4
    assert samples[("qflow_queue_messages_dequeued_total", "plain")] == 0
    assert samples[("qflow_queue_depth_messages", weird)] == 0
    assert samples[("qflow_connections", None)] == 1
    assert families["qflow_queue_flow_stopped"].type == "gauge"
    assert families["qflow_queue_held_transfers"].type == "gauge"
    assert families["qflow_queue_messages_enqueued"].type == "counter"
    status, _ = await mgmt.request("PATCH", "/api/queues/plain", {"arguments": {"qpid.flow_stop_count": 0,
                                                                             "qpid.flow_resume_count": 0}})
    assert status == 200
    with trio.fail_after(30):
        await sender.sync()
    await conn.close()


async def _agreeing_views(mgmt: Mgmt) -> dict[str, dict[str, Any]]:
    """Every queue as /api/queues shows it, after checking that /api/queues/{name},
    /api/broker's totals and every /metrics sample show the same numbers."""
    _, queues = await mgmt.request("GET", "/api/queues")
    _, broker = await mgmt.request("GET", "/api/broker")
    status, text = await mgmt.request("GET", "/metrics")
    assert status == 200
    samples = {(s.name, s.labels.get("queue")): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    by_name = {q["name"]: q for q in queues}
    for name, view in by_name.items():
        assert (await mgmt.request("GET", "/api/queues/" + quote(name, safe="")))[1] == view
        for metric, _type, _help, key in QUEUE_METRICS:
            assert samples[(metric, name)] == view[key], (metric, name)
    totals = broker["totals"]
    for metric, _help, key in BROKER_METRICS:
        assert samples[(metric, None)] == totals[key], metric
    for key in ("msgDepth", "byteDepth", "msgTotalEnqueues", "heldTransfers"):
        assert totals[key] == sum(q[key] for q in queues), key
    assert totals["flowStoppedQueues"] == sum(q["flowStopped"] for q in queues)
    return by_name


async def test_json_and_metrics_agree_through_a_flow_stop_and_resume(mgmt: Mgmt) -> None:
    await mgmt.request("PUT", "/api/queues/held", {"arguments": {"qpid.flow_stop_count": 3,
                                                                 "qpid.flow_resume_count": 1}})
    await mgmt.request("PUT", "/api/queues/idle")
    conn = await mgmt.running.connect()
    ssn = await conn.session()
    sender = ssn.sender("held", capacity=5)
    for _ in range(6):
        await sender.send(b"abcd")
    with trio.fail_after(30):  # 3 complete, then flow stops and holds the other 3
        while (await mgmt.request("GET", "/api/queues/held"))[1]["heldTransfers"] < 3:
            await trio.sleep(0.05)
    held = (await _agreeing_views(mgmt))["held"]
    assert (held["msgDepth"], held["byteDepth"], held["flowStopped"], held["flowStoppedCount"],
            held["heldTransfers"], held["heldSessionCount"]) == (6, 6 * 11, True, 1, 3, 1)  # "" 1, "held" 5, nil 1, 4

    # A resume through the API releases the held transfers; the views still agree.
    status, _ = await mgmt.request("PATCH", "/api/queues/held", {"arguments": {"qpid.flow_stop_count": 0,
                                                                            "qpid.flow_resume_count": 0}})
    assert status == 200
    with trio.fail_after(30):
        await sender.sync()
    held = (await _agreeing_views(mgmt))["held"]
    assert (held["msgDepth"], held["flowStopped"], held["flowStoppedCount"], held["heldTransfers"],
            held["heldSessionCount"]) == (6, False, 1, 0, 0)
    await conn.close()


# -- bad input: always a 4xx, never a 500, and the server stays up --------------------


@pytest.mark.parametrize(("method", "path", "body", "status", "text"), [
    ("PUT", "/api/queues/q", b"{not json", 400, "not valid JSON"),
    ("PUT", "/api/queues/q", b"[1, 2]", 400, "must be a JSON object"),
    ("PUT", "/api/queues/q", b'"text"', 400, "must be a JSON object"),
    ("PUT", "/api/queues/q", b"\xff\xfe", 400, "not UTF-8"),
    ("PUT", "/api/queues/q", b'{"durable": "yes"}', 400, "'durable' must be a boolean"),
    ("PUT", "/api/queues/q", b'{"arguments": [1]}', 400, "'arguments' must be an object"),
    ("PUT", "/api/queues/q", b'{"durabel": true}', 400, "unknown field"),
    ("PUT", "/api/queues/q", b'{"arguments": {"qpid.max_count": "ten"}}', 400, "qpid.max_count"),
    ("PUT", "/api/queues/q", b'{"arguments": {"qpid.max_count": -1}}', 400, "qpid.max_count"),
    ("PUT", "/api/queues/q", b'{"arguments": {"qpid.max_count": 1.5}}', 400, "qpid.max_count"),
    ("PUT", "/api/queues/q", b'{"arguments": {"qpid.max_count": true}}', 400, "qpid.max_count"),
    ("PUT", "/api/queues/q", b'{"arguments": {"qpid.policy_type": "drop"}}', 400, "qpid.policy_type"),
    ("PUT", "/api/queues/q", b'{"arguments": {"x": 1e999}}', 400, "out of range"),
    ("PUT", "/api/queues/q", b'{"arguments": {"x": NaN}}', 400, "not valid JSON"),
    ("PUT", "/api/queues/q", b'{"arguments": {"x": 99999999999999999999999}}', 400, "64 bits"),
    ("PUT", "/api/queues/q", b'{"arguments": {"x": "\\ud800"}}', 400, "surrogate"),
    ("PUT", "/api/queues/q", b'{"a": ' * 5000 + b"1" + b"}" * 5000, 400, ""),
    ("PUT", "/api/queues/q", b"[" * 100000, 400, ""),
    ("PUT", "/api/queues/" + "x" * 256, b"{}", 400, "1 to 255 bytes"),
    ("PUT", "/api/queues/%ff", b"{}", 400, "not UTF-8"),
    ("PUT", "/api/queues/new%0Aline", b"{}", 400, "control characters"),
    ("PUT", "/api/queues/esc%1B%5B2J", b"{}", 400, "control characters"),
    ("PUT", "/api/exchanges/e%7F", b'{"type": "direct"}', 400, "control characters"),
    ("PATCH", "/api/queues/missing", b'{"arguments": {}}', 404, "not found"),
    ("PATCH", "/api/queues/q0", b"{}", 400, "'arguments' is required"),
    ("DELETE", "/api/queues/q0?if_empty=maybe", b"", 400, "true or false"),
    ("DELETE", "/api/queues/q0?force=1", b"", 400, "unknown query parameter"),
    ("DELETE", "/api/queues/q0?if_empty=1&if_empty=0", b"", 400, "twice"),
    ("GET", "/api/queues/q0?x=%ff", b"", 400, "not UTF-8"),
    ("POST", "/api/queues/q0/purge", b'{"a": 1}', 400, "takes no body"),
    ("POST", "/api/bindings", b'{"exchange": 1, "queue": "q0"}', 400, "'exchange' must be a string"),
    ("POST", "/api/bindings", b'{"queue": "q0"}', 400, "'exchange' is required"),
    ("POST", "/api/bindings", b'{"exchange": "", "queue": "q0"}', 409, "fixed"),
    ("PUT", "/api/exchanges/e", b'{"type": 5}', 400, "'type' must be a string"),
    ("GET", "/api/nothing", b"", 404, "no such resource"),
    ("GET", "/api/queues/q0/purge", b"", 405, "not allowed"),
    ("POST", "/api/queues", b"", 405, "not allowed"),
    ("GET", "/api/queues/a/b/c", b"", 404, "no such resource"),
    ("GET", "/etc/passwd", b"", 404, "no such resource"),
    ("GET", "/api/../api/queues", b"", 404, "no such resource"),
    ("BREW", "/api/queues", b"", 405, "not allowed"),
])
async def test_bad_requests_get_a_4xx(mgmt: Mgmt, method: str, path: str, body: bytes, status: int,
                                      text: str) -> None:
    await mgmt.request("PUT", "/api/queues/q0")
    got, answer = await mgmt.request(method, path, raw=body)
    assert got == status, answer
    assert text in answer["error"]
    assert (await mgmt.request("GET", "/api/queues/q0"))[0] == 200  # still serving, state intact
    assert [q["name"] for q in (await mgmt.request("GET", "/api/queues"))[1]] == ["q0"]


async def test_malformed_http_is_refused_and_the_server_stays_up(mgmt: Mgmt) -> None:
    port = mgmt.port
    cases = [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /api/queues HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n", 400),
        (b"GET /api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n", 400),
        (b"GET /api/queues HTTP/9.9\r\nHost: 127.0.0.1\r\n\r\n", 505),
        (b"GET /api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-A: b\r\n" * 100 + b"\r\n", 431),
        (b"GET /api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 414),
        (b"GET \xff\xfe HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
        (b"GET http://127.0.0.1/api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 200),  # absolute-form is fine
        (b"GET http://host/api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 421),  # ... for the broker's names
        (b"OPTIONS * HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", 400),
    ]
    for data, status in cases:
        answer = await raw_exchange(port, data, shut=True)
        assert status_of(answer) == status, (data[:60], answer[:200])
    # A body over the limit is refused from its Content-Length, before it is read...
    big = MAX_BODY + 1
    answer = await raw_exchange(port, b"PUT /api/queues/q HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % big
                                + b"{" * 65536)
    assert status_of(answer) == 413 and "exceeds" in error_of(answer)
    # ...and a chunked one as soon as it passes the limit.
    chunk = b"%x\r\n%s\r\n" % (65536, b"a" * 65536)
    answer = await raw_exchange(port, b"PUT /api/queues/q HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                                + chunk * (MAX_BODY // 65536 + 2))
    assert status_of(answer) == 413
    # Expect: 100-continue is honoured.
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"PUT /api/queues/cont HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nExpect: 100-continue\r\n"
                              b"Content-Length: 2\r\nConnection: close\r\n\r\n")
        answer = b""
        with trio.fail_after(30):
            while b"\r\n\r\n" not in answer:
                answer += await stream.receive_some(65536)
            assert answer.startswith(b"HTTP/1.1 100 ")
            await stream.send_all(b"{}")
            while chunk := await stream.receive_some(65536):
                answer += chunk
    assert b"HTTP/1.1 201 " in answer
    # Client that vanishes mid-request, and one that closes at once.
    await raw_exchange(port, b"PUT /api/queues/q HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 10\r\n\r\n{", shut=True)
    await raw_exchange(port, b"", shut=True)
    assert (await mgmt.request("GET", "/api/queues"))[0] == 200
    assert [q["name"] for q in (await mgmt.request("GET", "/api/queues"))[1]] == ["cont"]
    await wait_idle(mgmt.server)


async def test_keep_alive_and_pipelining(mgmt: Mgmt) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", mgmt.port)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        for i in range(3):  # sequential requests on one connection
            await stream.send_all(conn.send(h11.Request(method="PUT", target=f"/api/queues/k{i}", headers=[
                ("host", "127.0.0.1"), ("content-type", "application/json"), ("content-length", "0")])) + conn.send(h11.EndOfMessage()))
            assert (await _read_response(conn, stream))[0] == 201
            conn.start_next_cycle()
    # Two requests in one write: both answered, in order.
    answer = await raw_exchange(mgmt.port, b"GET /api/queues/k0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                                b"GET /api/queues/k9 HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    first = answer.index(b"HTTP/1.1 200 ")
    assert answer.index(b"HTTP/1.1 404 ") > first and answer.count(b"HTTP/1.1 ") == 2
    # HTTP/1.0 without keep-alive and HEAD work too.
    answer = await raw_exchange(mgmt.port, b"GET /api/broker HTTP/1.0\r\n\r\n")
    assert status_of(answer) == 200 and b'"version"' in answer
    answer = await raw_exchange(mgmt.port, b"HEAD /api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    assert status_of(answer) == 200 and answer.endswith(b"\r\n\r\n")


async def test_slowloris_requests_time_out_while_others_are_served(mgmt: Mgmt) -> None:
    results: dict[str, bytes] = {}

    async def partial_headers() -> None:
        results["partial"] = await raw_exchange(mgmt.port, b"GET /api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\n")

    async def dribble() -> None:  # a byte every 0.3 s: each read succeeds, the deadline still ends it
        stream = await trio.open_tcp_stream("127.0.0.1", mgmt.port)
        got = b""
        async with stream:
            with trio.fail_after(30):
                try:
                    for byte in b"PUT /api/queues/slow HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}":
                        await stream.send_all(bytes([byte]))
                        await trio.sleep(0.3)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                while chunk := await _receive(stream):
                    got += chunk
        results["dribble"] = got

    async def idle() -> None:  # connects and says nothing: closed without an answer
        results["idle"] = await raw_exchange(mgmt.port, b"")

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial_headers)
        nursery.start_soon(dribble)
        nursery.start_soon(idle)
        await trio.sleep(0.2)
        # Meanwhile the server answers everyone else at once.
        for _ in range(5):
            assert (await mgmt.request("GET", "/api/broker"))[0] == 200
        assert trio.current_time() - started < TIMEOUT + 10
    assert status_of(results["partial"]) == 408 and "within" in error_of(results["partial"])
    assert status_of(results["dribble"]) == 408
    assert results["idle"] == b""
    assert (await mgmt.request("GET", "/api/queues/slow"))[0] == 404
    await wait_idle(mgmt.server)


async def _receive(stream: trio.SocketStream) -> bytes:
    try:
        return await stream.receive_some(65536)
    except trio.BrokenResourceError:
        return b""


async def test_connection_limit(nursery: trio.Nursery) -> None:
    running = await start_broker(nursery)
    server = ManagementServer(ManagementApi(running.broker, running.server), timeout=TIMEOUT, max_connections=2)
    port = await nursery.start(server.serve, "127.0.0.1", 0)
    a = await trio.open_tcp_stream("127.0.0.1", port)
    b = await trio.open_tcp_stream("127.0.0.1", port)
    with trio.fail_after(30):
        while server.active < 2:
            await trio.sleep(0.01)
    answer = await raw_exchange(port, b"GET /api/broker HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status_of(answer) == 503
    await a.aclose()
    await b.aclose()
    with trio.fail_after(30):
        while server.active:
            await trio.sleep(0.01)
    assert (await http(port, "GET", "/api/broker"))[0] == 200


# -- the daemon ------------------------------------------------------------------------


def _sync_request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_qflowd_serves_the_api_on_its_ready_line_port() -> None:
    d = start_qflowd("--mgmt-port", "0", "--default-flow-stop-threshold", "90",
                     "--default-flow-resume-threshold", "75")
    try:
        assert d.mgmt_port not in (0, d.port)
        for junk in (b"\x00\x01\x02garbage\r\n\r\n", b"PUT /api/queues/x HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 9\r\n\r\n{\"durable", b"GET /api/%zz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"):
            assert 400 <= status_of(_sync_request(d.mgmt_port, junk)) < 500
        answer = _sync_request(d.mgmt_port, b"GET /api/broker HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        info = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert info["options"]["port"] == d.port and info["options"]["mgmtPort"] == d.mgmt_port
        assert (info["options"]["defaultFlowStopThreshold"], info["options"]["defaultFlowResumeThreshold"]) == (90, 75)
        assert d.proc.poll() is None
    finally:
        d.stop()


def test_qflowd_management_options() -> None:
    for bad in (["--mgmt-port", "70000"], ["--mgmt-port", "x"], ["--mgmt-timeout", "0"]):
        proc = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", "--no-data-dir", *bad],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (bad, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1 and "qflowd:" in proc.stderr
    # A management port already taken: one line, exit 1.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", "--no-data-dir",
                               "--mgmt-port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port} (management)" in proc.stderr
    assert "Traceback" not in proc.stderr


def _held_connection(port: int, source: str) -> socket.socket:
    """A keep-alive connection from ``source`` that has had one answer and stays open (so the
    server counts it), then starts a request it never finishes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    s.sendall(b"GET /api/broker HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    answer = b""
    while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < int(
            re.search(rb"content-length: (\d+)", answer.split(b"\r\n\r\n", 1)[0], re.I).group(1)):
        chunk = s.recv(65536)
        assert chunk, answer
        answer += chunk
    assert status_of(answer) == 200
    s.sendall(b"GET /api/queues HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")  # unfinished
    return s


def _sync_request_from(port: int, source: str) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0)) as s:
        s.sendall(b"GET /api/broker HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_one_client_holding_unfinished_requests_cannot_take_every_slot() -> None:
    """Issue 17: "About 64 unfinished management requests, refreshed as they
    expire, made the operator's requests fail with 503." Each client (peer
    address) has at most 8 connections at once: its next ones are answered
    429 naming the limit, the operator (another address) is served, and the
    held ones time out (408) and free their slots."""
    d = start_qflowd("--mgmt-port", "0", "--mgmt-timeout", "3")
    held: list[socket.socket] = []
    try:
        held = [_held_connection(d.mgmt_port, "127.0.0.2") for _ in range(8)]
        for _ in range(56):  # the rest of the 64 the client held
            refused = _sync_request_from(d.mgmt_port, "127.0.0.2")
            assert status_of(refused) == 429
            assert "127.0.0.2" in error_of(refused) and "limit per client is 8" in error_of(refused)
        for _ in range(3):
            assert status_of(_sync_request_from(d.mgmt_port, "127.0.0.1")) == 200
        for s in held:  # slow requests time out
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
            assert status_of(answer) == 408, answer
        assert status_of(_sync_request_from(d.mgmt_port, "127.0.0.2")) == 200  # the slots are free again
        assert d.proc.poll() is None
    finally:
        for s in held:
            s.close()
        d.stop()
