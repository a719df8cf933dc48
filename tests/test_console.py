"""The web console of issue 18 (qflow/management/console, events.py, the
server's event streams):

> A live web console on the management port: a queues table (depth, bytes,
> thresholds, flowStopped, flowStoppedCount, held producers, enqueue/dequeue
> rates); per queue, a live chart of depth against its stop and resume
> thresholds, with the flow on/off periods shaded; connections and sessions,
> with what holds them and since when; actions: purge, change thresholds,
> delete. Updates are pushed. The test drives a queue into flow control with
> a real sender and checks that the page shows flowStopped within two seconds.

The browser tests drive Debian's Chromium (installed by the Makefile) with
Playwright against real qflowd processes and the real qflow-send; every
action is checked against the broker's own API. The units check the event
stream's rates and framing, the stream limits and the bounded send on the
real HTTP server, and that the assets are package data.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from playwright.sync_api import expect, sync_playwright
from proton.reactor import Container
from proton.utils import BlockingConnection

from qflow.broker import Broker
from qflow.broker.acl import parse
from qflow.management import ManagementApi, ManagementServer
from qflow.management.api import SNAPSHOT_STEP
from qflow.management.console import ASSETS
from qflow.management.events import EventStream, Feed
from qflow.testing import Daemon, chromium
from tests.conftest import start_qflowd
from tests.test_auth import passwd
from tests.test_tools import DEADLINE, command, config, ok

# The browser and HTTP do not depend on the accounting implementation: run once.
pytestmark = pytest.mark.native_only

ROOT = Path(__file__).resolve().parent.parent
SHOWN_WITHIN = 2.0  # seconds, from the broker's API reporting a change to the page showing it (the figure)
MS = 1000


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = start_qflowd("--mgmt-port", "0", "--mgmt-timeout", "2")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def playwright() -> Iterator[Any]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    context = chromium(playwright, str(tmp_path_factory.mktemp("chromium")), timeout=DEADLINE)
    try:
        yield context
    finally:
        context.close()


def get(d: Daemon, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any, bytes]:
    """(status, headers (case-insensitive), body) of a GET."""
    request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def api(d: Daemon, path: str) -> Any:
    status, _, body = get(d, path)
    assert status == 200, (path, status, body)
    return json.loads(body)


def until(what: str, check: Any) -> Any:
    """Poll ``check`` until it gives something true (no timing assertion: the deadline is generous)."""
    deadline = time.monotonic() + DEADLINE
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def sender(d: Daemon, queue: str, messages: int, capacity: int) -> subprocess.Popen[str]:
    return subprocess.Popen(command("qflow-send") + ["-b", d.address, "-a", queue, "-m", str(messages),
                                                     "--capacity", str(capacity), "--content-size", "16"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=DEADLINE)
    assert proc.returncode == 0, (out, err)
    return out


# -- in a real browser -----------------------------------------------------------------------------


def test_the_page_shows_flow_control_within_two_seconds_charts_it_and_its_actions_work(daemon, browser):
    d = daemon
    ok(config(d, "add", "queue", "orders", "--flow-stop-count", "20", "--flow-resume-count", "10"))
    page = browser.new_page()
    dialogs: list[str] = []
    answers: list[bool] = []

    def on_dialog(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.accept() if answers.pop(0) else dialog.dismiss()

    page.on("dialog", on_dialog)
    page.goto(f"http://127.0.0.1:{d.mgmt_port}/", timeout=DEADLINE * MS)
    row = page.locator('#queues tr[data-queue="orders"]')
    expect(row.locator("td.flowStopped")).to_have_text("N", timeout=DEADLINE * MS)
    expect(page.locator("#status")).to_have_text("live")

    # A real producer with a window of 30 against a stop count of 20: the queue holds it.
    producer = sender(d, "orders", 100, 30)
    try:
        until("the broker to report orders flowStopped", lambda: api(d, "/api/queues/orders")["flowStopped"])
        expect(row.locator("td.flowStopped")).to_have_text("Y", timeout=SHOWN_WITHIN * MS)

        q = api(d, "/api/queues/orders")
        expect(row.locator("td.countThresholds")).to_have_text("20 / 10")
        expect(row.locator("td.held")).to_have_text("1", timeout=DEADLINE * MS)  # one producer session held
        expect(row.locator("td.flowStoppedCount")).to_have_text(str(q["flowStoppedCount"]))
        expect(row.locator("td.msgDepth")).to_have_text(str(q["msgDepth"]), timeout=DEADLINE * MS)
        expect(row.locator("td.byteDepth")).to_have_text(str(q["byteDepth"]), timeout=DEADLINE * MS)
        # Rates are numbers once two snapshots have been seen (messages per second, maybe 0.0 now it is held).
        expect(row.locator("td.enqueueRate")).to_have_text(re.compile(r"^\d+(\.\d)?$"), timeout=DEADLINE * MS)
        expect(row.locator("td.dequeueRate")).to_have_text(re.compile(r"^\d+(\.\d)?$"), timeout=DEADLINE * MS)

        # The chart: depth against the stop (20) and resume (10) lines, the stopped period shaded.
        chart = page.locator('#charts figure.chart[data-queue="orders"]')
        expect(chart.locator("line.stop-line")).to_have_attribute("data-value", "20", timeout=DEADLINE * MS)
        expect(chart.locator("line.resume-line")).to_have_attribute("data-value", "10")
        expect(chart.locator("rect.stopped").first).to_be_attached(timeout=SHOWN_WITHIN * MS)
        expect(chart.locator("polyline.depth")).to_be_attached()

        # Connections and sessions: the producer's session, held by orders, since when.
        held = page.locator("#connections td.heldBy", has_text="orders since")
        expect(held).to_have_count(1, timeout=DEADLINE * MS)
        expect(held).to_have_text(re.compile(r"^orders since \d\d:\d\d:\d\d \([\d.]+ s\)$"))

        # Change the thresholds from the page: stop 1000, resume 500. The queue resumes, the producer finishes.
        row.locator("button.edit").click()
        page.fill('#thresholds input[name="qpid.flow_stop_count"]', "1000")
        page.fill('#thresholds input[name="qpid.flow_resume_count"]', "500")
        page.click("#thresholds-apply")
        q = until("the new thresholds", lambda: (lambda q: q["flowStopCount"] == 1000 and q)(
            api(d, "/api/queues/orders")))
        assert (q["flowStopCount"], q["flowResumeCount"]) == (1000, 500)
        assert q["arguments"]["qpid.flow_stop_count"] == 1000
        finished(producer)
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()
    assert api(d, "/api/queues/orders")["msgDepth"] == 100
    expect(row.locator("td.countThresholds")).to_have_text("1000 / 500", timeout=SHOWN_WITHIN * MS)
    expect(row.locator("td.flowStopped")).to_have_text("N", timeout=SHOWN_WITHIN * MS)
    expect(row.locator("td.msgDepth")).to_have_text("100", timeout=SHOWN_WITHIN * MS)

    # Purge asks first; declined, nothing happens.
    answers.append(False)
    row.locator("button.purge").click()
    assert dialogs[-1] == 'Purge queue "orders"? Its 100 messages are removed for good.'
    answers.append(True)
    row.locator("button.purge").click()
    expect(page.locator("#message")).to_have_text('Purged 100 messages from "orders".', timeout=DEADLINE * MS)
    assert api(d, "/api/queues/orders")["msgDepth"] == 0
    expect(row.locator("td.msgDepth")).to_have_text("0", timeout=SHOWN_WITHIN * MS)

    # A refusal is shown with the API's own words: a resume above the stop.
    row.locator("button.edit").click()
    page.fill('#thresholds input[name="qpid.flow_resume_count"]', "2000")
    page.click("#thresholds-apply")
    expect(page.locator("#message")).to_have_text(re.compile(r"PATCH /api/queues/orders: 400 .*qpid\.flow_resume_count"),
                                                  timeout=DEADLINE * MS)
    assert api(d, "/api/queues/orders")["flowResumeCount"] == 500
    page.click("#thresholds-cancel")

    # Delete asks first; declined, the queue stays; accepted, it is gone from the broker and the page.
    answers.append(False)
    row.locator("button.delete").click()
    assert dialogs[-1] == 'Delete queue "orders" and every message on it?'
    answers.append(True)
    row.locator("button.delete").click()
    expect(page.locator("#message")).to_have_text('Deleted queue "orders" (0 messages).', timeout=DEADLINE * MS)
    assert get(d, "/api/queues/orders")[0] == 404
    expect(row).to_have_count(0, timeout=SHOWN_WITHIN * MS)
    assert not answers and len(dialogs) == 4
    page.close()


def test_a_queue_name_is_shown_as_text_never_run_as_html(daemon, browser):
    d = daemon
    name = '<img src=x onerror="window.pwned=1">'
    status, _, body = get(d, "/")  # the page is there before the queue
    assert status == 200
    request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}/api/queues/{urllib.parse.quote(name, safe='')}",
                                     data=b"{}", method="PUT", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=DEADLINE) as response:
        assert response.status == 201
    page = browser.new_page()
    try:
        page.goto(f"http://127.0.0.1:{d.mgmt_port}/", timeout=DEADLINE * MS)
        expect(page.locator("#queues td.name", has_text=name)).to_have_count(1, timeout=DEADLINE * MS)
        assert page.evaluate("window.pwned") is None
        assert page.locator("#queues img").count() == 0
    finally:
        page.close()


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    db = tmp_path_factory.mktemp("console-auth") / "users.json"
    ok(passwd(db, "alice", "s3cret", "--iterations", "4096"))
    d = start_qflowd("--mgmt-port", "0", "--auth", "yes", "--sasl-db", str(db))
    try:
        yield d
    finally:
        d.stop()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def test_with_auth_the_page_its_files_and_its_stream_need_credentials(secured, playwright, tmp_path):
    d = secured
    for path in ("/", "/console/console.js", "/console/console.css", "/api/events"):
        status, headers, body = get(d, path)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Basic"), (path, status)
        assert "authentication required" in json.loads(body)["error"]
        assert get(d, path, basic("alice", "wrong"))[0] == 401
    status, headers, body = get(d, "/", basic("alice", "s3cret"))
    assert status == 200 and headers["Content-Type"].startswith("text/html") and b"qflowd console" in body

    # The browser, given the user's credentials, shows the broker live (its EventSource and fetches
    # carry them as any same-origin request does).
    request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}/api/queues/secured", data=b"{}", method="PUT",
                                     headers={"Content-Type": "application/json", **basic("alice", "s3cret")})
    with urllib.request.urlopen(request, timeout=DEADLINE) as response:
        assert response.status == 201
    context = chromium(playwright, str(tmp_path / "profile"), timeout=DEADLINE,
                       http_credentials={"username": "alice", "password": "s3cret"})
    try:
        page = context.new_page()
        page.goto(f"http://127.0.0.1:{d.mgmt_port}/", timeout=DEADLINE * MS)
        expect(page.locator('#queues tr[data-queue="secured"] td.msgDepth')).to_have_text("0", timeout=DEADLINE * MS)
        expect(page.locator("#status")).to_have_text("live")
    finally:
        context.close()


# -- the event stream over HTTP ------------------------------------------------------------------


def raw_request(port: int, head: bytes, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE, source_address=(source, 0))
    s.sendall(head)
    return s


def read_until(s: socket.socket, marker: bytes, have: bytes = b"") -> bytes:
    data = have
    while marker not in data:
        chunk = s.recv(65536)
        assert chunk, f"closed before {marker!r}: {data[-500:]!r}"
        data += chunk
    return data


def open_stream(port: int, source: str = "127.0.0.1") -> tuple[socket.socket, bytes]:
    """A GET /api/events: the socket and what was read up to the end of the first event."""
    s = raw_request(port, b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n", source)
    return s, read_until(s, b"\n\n", read_until(s, b"\r\n\r\n"))


def snapshots(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


def test_the_event_stream_obeys_the_request_guard(daemon):
    for host in (b"evil.example", b"evil.example:80", b"127.0.0.1.nip.io"):
        s = raw_request(daemon.mgmt_port, b"GET /api/events HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        with s:
            answer = read_until(s, b"}\n")
        assert answer.startswith(b"HTTP/1.1 421 "), answer
        assert b"is not a name of this broker" in answer and b"text/event-stream" not in answer
    # The console's actions are the API's routes: a foreign Origin is refused as for any client.
    request = urllib.request.Request(f"http://127.0.0.1:{daemon.mgmt_port}/api/queues/x/purge", data=b"", method="POST",
                                     headers={"Content-Type": "application/json", "Origin": "http://evil.example"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=DEADLINE)
    assert info.value.code == 403


def test_a_head_of_the_stream_is_its_head_alone(daemon):
    s = raw_request(daemon.mgmt_port, b"HEAD /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    with s:
        data = read_until(s, b"\r\n\r\n")
        while chunk := s.recv(65536):  # the server closes after the head: nothing follows it
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"\r\n\r\n"), data
    assert b"content-type: text/event-stream" in data.lower()


def test_the_stream_is_exempt_from_the_request_timeout_and_bounded_per_client(daemon):
    """The daemon's --mgmt-timeout is 2 s. A stream outlives it while read; a client has at most
    4 streams (half its 8 connections), so its tools and the console's own actions still get in."""
    d = daemon
    # A stream of a page closed by an earlier test ends at its next write: until then it may hold a slot.
    first, data = until("a stream slot", lambda: _stream_or_none(d.mgmt_port, first_event=True))
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200 ") and b"content-type: text/event-stream" in head
    assert b"transfer-encoding: chunked" in head and b"cache-control: no-store" in head
    assert b"retry: 2000\n" in data
    snap = snapshots(data)[0]
    assert set(snap) == {"time", "user", "broker", "queues", "connections"} and snap["user"] == "anonymous"
    streams = [first]
    try:
        started = time.monotonic()
        events = 1
        while time.monotonic() - started < 3 * 2:  # three times the request timeout, and still events come
            data = read_until(first, b"\n\n", b"")
            events += data.count(b"event: snapshot")
        assert events >= 2
        for _ in range(3):
            streams.append(until("a stream slot", lambda: _stream_or_none(d.mgmt_port))[0])
        fifth = raw_request(d.mgmt_port, b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        with fifth:
            answer = read_until(fifth, b"}\n")
        assert answer.startswith(b"HTTP/1.1 429 "), answer
        assert b"too many event streams from 127.0.0.1: 4, the limit per client is 4" in answer
        # Not locked out: the same client's API requests and tools are served beside its 4 streams.
        assert api(d, "/api/broker")["name"] == "qflowd"
        ok(config(d, "queues"))
        # A stream closed by its client frees its slot (the server sees it at its next write).
        streams.pop().close()
        streams.append(until("a freed stream slot", lambda: _stream_or_none(d.mgmt_port))[0])
    finally:
        for s in streams:
            s.close()


def _stream_or_none(port: int, first_event: bool = False) -> tuple[socket.socket, bytes] | None:
    """A new stream (and what was read of it), or None if it was refused as one too many."""
    s = raw_request(port, b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = read_until(s, b"\r\n\r\n")
    if data.startswith(b"HTTP/1.1 200 "):
        return s, read_until(s, b"\n\n", data) if first_event else data
    s.close()
    assert data.startswith(b"HTTP/1.1 429 "), data
    return None


async def test_the_streams_of_all_clients_are_bounded_too():
    broker = Broker()
    server = ManagementServer(ManagementApi(broker), max_streams=2, max_streams_per_client=2)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)

        async def stream_from(source: str) -> tuple[trio.SocketStream, bytes]:
            s = trio.socket.socket()
            await s.bind((source, 0))
            await s.connect(("127.0.0.1", port))
            stream = trio.SocketStream(s)
            await stream.send_all(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                data += await stream.receive_some(65536)
            return stream, data

        with trio.fail_after(DEADLINE):
            a, answer = await stream_from("127.0.0.1")
            assert answer.startswith(b"HTTP/1.1 200 ")
            b, answer = await stream_from("127.0.0.2")
            assert answer.startswith(b"HTTP/1.1 200 ")
            c, answer = await stream_from("127.0.0.3")
            assert answer.startswith(b"HTTP/1.1 503 ") and b"too many event streams: 2, the limit is 2" in answer
            assert server.streams == 2 and server.streams_per_client == {"127.0.0.1": 1, "127.0.0.2": 1}
            for s in (a, b, c):
                await s.aclose()
            while server.streams:  # each ends at its next write, which fails
                await trio.sleep(0.01)
            assert server.streams_per_client == {}
        nursery.cancel_scope.cancel()


async def test_a_client_that_stops_reading_costs_one_event_and_is_dropped(autojump_clock, caplog):
    """The next event is built only once the last one is written, so a stalled client holds one
    event's memory at most; after the request timeout without a write, it is dropped."""
    broker = Broker()
    built: list[EventStream] = []

    class Api(ManagementApi):
        def events(self, *, query: dict[str, str], body: bytes) -> EventStream:
            stream = super().events(query=query, body=body)
            built.append(stream)
            return stream

    server = ManagementServer(Api(broker), timeout=10)
    client, ours = trio.testing.lockstep_stream_pair()  # a write waits until the other side reads: nobody does
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_all, b"GET /api/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
        with trio.fail_after(60):
            await server._connection(ours, "stalled")  # returns once it has dropped the client
    assert len(built) == 1 and built[0].sent == 1
    assert server.streams == 0 and server.streams_per_client == {}
    assert "event stream to ? dropped: an event was not read within 10 seconds" in caplog.text


# -- units: the feed, the page's files --------------------------------------------------------------


def in_steps(snapshot: Any) -> Any:
    """A snapshot function as the feed takes it: its queues in one step, then the rest."""
    def steps() -> Any:
        yield snapshot()["queues"]
        return {"time": "2026-01-01T00:00:00.000Z", "user": "u", "broker": None, "connections": []}
    return steps


def test_rates_are_counters_between_two_snapshots_of_the_stream():
    now = [100.0]
    counts = {"enq": 0, "deq": 0, "incarnation": "a"}

    def snapshot() -> dict[str, Any]:
        return {"queues": [{"name": "q", "incarnation": counts["incarnation"], "msgTotalEnqueues": counts["enq"],
                            "msgTotalDequeues": counts["deq"]}]}

    stream = EventStream(Feed(in_steps(snapshot), lambda: now[0]))
    first = stream.next_event()
    assert first.startswith(b"retry: 2000\nevent: snapshot\ndata: ") and first.endswith(b"\n\n")
    assert first.count(b"\n") == 4  # one data line
    q = snapshots(first)[0]["queues"][0]
    assert (q["enqueueRate"], q["dequeueRate"]) == (None, None)  # no interval yet
    now[0] += 0.5
    counts.update(enq=500, deq=150)
    second = stream.next_event()
    assert second.startswith(b"event: snapshot\n")
    q = snapshots(second)[0]["queues"][0]
    assert (q["enqueueRate"], q["dequeueRate"]) == (1000.0, 300.0)
    now[0] += 2.0
    counts.update(enq=501)
    q = snapshots(stream.next_event())[0]["queues"][0]
    assert (q["enqueueRate"], q["dequeueRate"]) == (0.5, 0.0)
    # Deleted and declared again (a new incarnation, counters from 0): no negative rate, a fresh start.
    now[0] += 0.5
    counts.update(enq=3, deq=0, incarnation="b")
    q = snapshots(stream.next_event())[0]["queues"][0]
    assert (q["enqueueRate"], q["dequeueRate"]) == (None, None)
    assert stream.sent == 4


def test_a_stream_waits_longer_when_its_snapshots_are_costly():
    """However many queues, a stream spends at most 1/20 of its time building snapshots."""
    now = [0.0]
    cost = [0.001]

    def snapshot() -> dict[str, Any]:
        now[0] += cost[0]  # building it takes this long
        return {"queues": []}

    stream = EventStream(Feed(in_steps(snapshot), lambda: now[0]))
    stream.next_event()
    assert stream.interval == 0.5  # cheap: every half second
    cost[0] = 0.2
    now[0] += 0.5
    stream.next_event()
    assert stream.interval == pytest.approx(4.0)  # 0.2 s to build: 4 s between two
    now[0] += 1.0
    stream.next_event()
    assert stream.feed.built == 2  # within its interval, the latest snapshot is sent again
    cost[0] = 0.01
    now[0] += 4.0
    stream.next_event()
    assert stream.interval == 0.5 and stream.feed.built == 3


def test_a_snapshot_is_built_in_steps_and_leaves_out_a_queue_deleted_meanwhile():
    """So a broker of many queues serves everyone else between two steps (http.py checkpoints there)."""
    broker = Broker()
    api = ManagementApi(broker)
    for i in range(2 * SNAPSHOT_STEP + 10):
        broker.declare_queue(f"q{i:05d}")
    steps = api.snapshot_steps("anonymous")
    first = next(steps)
    assert len(first) == SNAPSHOT_STEP and first[0]["name"] == "q00000"
    broker.delete_queue(f"q{SNAPSHOT_STEP:05d}")  # between two steps, as another request may
    second = next(steps)
    assert len(second) == SNAPSHOT_STEP - 1 and second[0]["name"] == f"q{SNAPSHOT_STEP + 1:05d}"
    assert len(next(steps)) == 10
    with pytest.raises(StopIteration) as done:
        next(steps)
    assert done.value.value["broker"]["totals"]["msgDepth"] == 0 and done.value.value["user"] == "anonymous"
    # The event a stream sends is that whole snapshot, one JSON object.
    steps = api.handle("GET", b"/api/events").next_event_steps()
    yielded = 0
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            event = stop.value
            break
        yielded += 1
    assert yielded == 3
    sent = snapshots(event)[0]
    assert len(sent["queues"]) == 2 * SNAPSHOT_STEP + 9 and sent["broker"]["totals"]["queues"] == 2 * SNAPSHOT_STEP + 9


def test_the_streams_of_one_user_share_one_feed():
    """However many consoles a user opens, one snapshot is built and encoded per interval."""
    api = ManagementApi(Broker())
    api.handle("PUT", b"/api/queues/q")
    a, b, c = (api.handle("GET", b"/api/events", user=user) for user in ("alice", "alice", "bob"))
    assert a.feed is b.feed and a.feed is not c.feed
    now = [0.0]
    a.feed.clock = lambda: now[0]
    first = a.next_event()
    assert b.next_event() == first  # both first events: each with the reconnection delay
    assert a.next_event() == b.next_event() == first.removeprefix(b"retry: 2000\n")
    assert a.feed.built == 1
    now[0] += 0.5
    a.next_event()
    assert a.feed.built == 2
    del a, b, c
    assert len(api._feeds) == 0  # a feed lives as long as a stream uses it


def test_the_snapshot_shows_what_the_routes_show_and_an_acl_filters_it_alike():
    broker = Broker()
    api = ManagementApi(broker)
    for name in ("carol.q", "other"):
        assert api.handle("PUT", b"/api/queues/" + name.encode()).status == 201
    snap = api.snapshot("anonymous")
    assert [q["name"] for q in snap["queues"]] == ["carol.q", "other"]
    assert snap["queues"] == json.loads(api.handle("GET", b"/api/queues").body)
    assert snap["broker"]["totals"]["queues"] == 2 and snap["connections"] == []
    broker.set_acl(parse("acl allow carol access queue name=carol.*\nacl deny all all\n"))
    snap = api.snapshot("carol")
    assert [q["name"] for q in snap["queues"]] == ["carol.q"]
    assert snap["broker"] is None  # the broker's totals need access broker, as GET /api/broker does
    stream = api.handle("GET", b"/api/events", user="carol")
    assert isinstance(stream, EventStream)
    api.handle("GET", b"/api/queues", user="anonymous")  # another user's request in between
    assert [q["name"] for q in snapshots(stream.next_event())[0]["queues"]] == ["carol.q"]
    assert api.handle("GET", b"/api/events?x=1").status == 400
    assert api.handle("POST", b"/api/events").status == 405


def test_the_page_and_its_files_are_served_with_a_strict_policy():
    api = ManagementApi(Broker())
    page = api.handle("GET", b"/")
    assert page.status == 200 and page.content_type == "text/html; charset=utf-8"
    assert b'<script src="/console/console.js"' in page.body and b"<script>" not in page.body  # nothing inline
    headers = dict(page.headers)
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "connect-src 'self'" in headers["content-security-policy"]
    assert "frame-ancestors 'none'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    assert api.handle("GET", b"/console/console.js").content_type == "text/javascript; charset=utf-8"
    assert api.handle("GET", b"/console/console.css").content_type == "text/css; charset=utf-8"
    for bad in (b"/console/nope.js", b"/console/..%2F__init__.py", b"/console/__init__.py"):
        answer = api.handle("GET", bad)
        assert answer.status == 404 and "no such console file" in json.loads(answer.body)["error"]
    # Nothing the page loads comes from elsewhere: no URL with a scheme or host in the assets.
    for name in ASSETS:
        text = api.handle("GET", b"/console/" + name.encode()).body.decode()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", text.replace("http://www.w3.org/2000/svg", "")), name
    index = json.loads(api.handle("GET", b"/api").body)
    assert "GET /api/events" in index["endpoints"] and "GET /api/queues" in index["endpoints"]


def test_the_console_is_served_from_a_built_package(tmp_path):
    """The files are package data: setuptools' build_py (what a wheel is made of) of a copy of the
    checkout carries them, and the console module there serves them, byte for byte."""
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".venv", ".git", "tests", "docs", "bench", "examples", "build", "*.egg-info", "__pycache__", "*.so"))
    built = tmp_path / "built"
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(built)], cwd=source, check=True,
                   capture_output=True, timeout=DEADLINE)
    script = ("import json, qflow.management.console as c\n"
              "print(json.dumps([c.__file__, {n: c.asset(n)[0].decode() for n in c.ASSETS}]))")
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(built)},
                            capture_output=True, text=True, timeout=DEADLINE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    where, served = json.loads(result.stdout)
    assert where == str(built / "qflow" / "management" / "console" / "__init__.py")
    console = ROOT / "qflow" / "management" / "console"
    assert served == {name: (console / name).read_text() for name in ASSETS}
    assert {p.name for p in console.iterdir() if p.is_file() and p.suffix != ".py"} == set(ASSETS)


def test_a_connection_is_closed_from_its_row_and_the_close_is_logged(daemon, browser):
    d = daemon
    ok(config(d, "add", "queue", "victim-q"))
    victim = subprocess.Popen(command("qflow-receive") + ["-b", d.address, "-a", "victim-q", "--forever",
                                                          "--connection-name", "victim"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        peer = until("the receiver's connection", lambda: next(
            (c["peer"] for c in api(d, "/api/connections") if c["name"] == "victim"), None))
        page = browser.new_page()
        dialogs: list[str] = []

        def on_dialog(dialog: Any) -> None:
            dialogs.append(dialog.message)
            dialog.accept()

        page.on("dialog", on_dialog)
        page.goto(f"http://127.0.0.1:{d.mgmt_port}/", timeout=DEADLINE * MS)
        page.locator(f'#connections tr[data-connection="{peer}"] button.close').click()
        expect(page.locator("#message")).to_have_text(f"Closed the connection victim {peer}.", timeout=DEADLINE * MS)
        assert dialogs[0].startswith(f"Close the connection victim {peer}?")
        _out, err = victim.communicate(timeout=DEADLINE)
        assert victim.returncode == 1 and "closed by an operator (user 'anonymous', management API)" in err, err
        expect(page.locator(f'#connections tr[data-connection="{peer}"]')).to_have_count(0, timeout=DEADLINE * MS)
        page.close()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.communicate()
    log = d.log()
    assert re.search(rf"management change by 127\.0\.0\.1:\d+ \(user 'anonymous'\): DELETE /api/connections/"
                     rf"{re.escape(peer.replace(':', '%3A'))} done \(200\)", log), log[-3000:]
    assert f"connection {peer} closed: name 'victim', user 'anonymous': closed by an operator" in log


def test_a_queue_and_a_binding_are_created_from_the_page_and_a_refusal_shows_the_apis_words(daemon, browser):
    d = daemon
    page = browser.new_page()
    try:
        page.goto(f"http://127.0.0.1:{d.mgmt_port}/", timeout=DEADLINE * MS)
        expect(page.locator("#status")).to_have_text("live", timeout=DEADLINE * MS)
        message = page.locator("#message")

        # A durable queue with a flow threshold: a whole number goes as a number, as qflow-config sends it.
        page.fill("#new-queue input[name=name]", "made-here")
        page.check("#new-queue input[name=durable]")
        page.fill("#new-queue textarea[name=arguments]", "qpid.flow_stop_count=100\n\n  qpid.flow_resume_count = 50 \n")
        page.click("#new-queue-create")
        expect(message).to_have_text('Created durable queue "made-here".', timeout=DEADLINE * MS)
        q = api(d, "/api/queues/made-here")
        assert q["durable"] is True and q["autoDelete"] is False
        assert q["arguments"] == {"qpid.flow_stop_count": 100, "qpid.flow_resume_count": 50}
        assert (q["flowStopCount"], q["flowResumeCount"]) == (100, 50)
        expect(page.locator('#queues tr[data-queue="made-here"] td.countThresholds')).to_have_text(
            "100 / 50", timeout=SHOWN_WITHIN * MS)
        assert page.input_value("#new-queue input[name=name]") == ""  # the form is cleared for the next one

        # An argument qflow does not support: the broker refuses it, the page says so, nothing is created.
        page.fill("#new-queue input[name=name]", "last-value")
        page.fill("#new-queue textarea[name=arguments]", "qpid.last_value_queue_key=sym")
        page.click("#new-queue-create")
        expect(message).to_have_text(
            "PUT /api/queues/last-value: 400 queue.declare 'last-value': queue argument 'qpid.last_value_queue_key' "
            "(Qpid: a last-value queue) is not supported by qflow", timeout=DEADLINE * MS)
        expect(message).to_have_attribute("data-kind", "error")
        assert get(d, "/api/queues/last-value")[0] == 404

        # A name the broker refuses, in its words; a line that is no KEY=VALUE, refused before any request.
        page.fill("#new-queue input[name=name]", "n" * 300)
        page.fill("#new-queue textarea[name=arguments]", "")
        page.click("#new-queue-create")
        expect(message).to_have_text(re.compile(r"^PUT /api/queues/n{300}: 400 queue name 'n+': "
                                                r"a name must be 1 to 255 bytes, got 300$"), timeout=DEADLINE * MS)
        page.fill("#new-queue input[name=name]", "no-pair")
        page.fill("#new-queue textarea[name=arguments]", "qpid.max_count=5\nqpid.flow_stop_count")
        page.click("#new-queue-create")
        expect(message).to_have_text('New queue: arguments, line 2: expected KEY=VALUE, got "qpid.flow_stop_count"',
                                     timeout=DEADLINE * MS)
        page.fill("#new-queue textarea[name=arguments]", "qpid.max_count=9007199254740993")
        page.click("#new-queue-create")
        expect(message).to_have_text(re.compile(r"^New queue: arguments, line 1: qpid\.max_count: 9007199254740993 "
                                                r"is beyond the integers a browser sends exactly"),
                                     timeout=DEADLINE * MS)
        assert get(d, "/api/queues/no-pair")[0] == 404

        # The same queue again, same settings: the API's 200, said as such.
        page.fill("#new-queue input[name=name]", "made-here")
        page.check("#new-queue input[name=durable]")
        page.fill("#new-queue textarea[name=arguments]", "qpid.flow_stop_count=100\nqpid.flow_resume_count=50")
        page.click("#new-queue-create")
        expect(message).to_have_text('Queue "made-here" exists already, with these settings.', timeout=DEADLINE * MS)

        # A binding: it exists afterwards; a second time it is said to exist already.
        page.fill("#new-binding input[name=exchange]", "amq.topic")
        page.fill("#new-binding input[name=queue]", "made-here")
        page.fill("#new-binding input[name=key]", "orders.#")
        page.click("#new-binding-create")
        expect(message).to_have_text('Bound queue "made-here" to exchange "amq.topic" with key "orders.#".',
                                     timeout=DEADLINE * MS)
        assert {"exchange": "amq.topic", "queue": "made-here", "key": "orders.#"} in [
            {k: b[k] for k in ("exchange", "queue", "key")} for b in api(d, "/api/bindings")]
        page.click("#new-binding-create")
        expect(message).to_have_text('Already bound: queue "made-here" to exchange "amq.topic" with key "orders.#".',
                                     timeout=DEADLINE * MS)
        # A binding the broker refuses, in its words.
        page.fill("#new-binding input[name=queue]", "no-such-queue")
        page.click("#new-binding-create")
        expect(message).to_have_text("POST /api/bindings: 404 exchange.bind: queue 'no-such-queue' not found",
                                     timeout=DEADLINE * MS)
        assert not [b for b in api(d, "/api/bindings") if b["queue"] == "no-such-queue"]
    finally:
        page.close()
    ok(config(d, "del", "queue", "made-here", "--force"))
    log = d.log()
    assert re.search(r"management change by 127\.0\.0\.1:\d+ \(user 'anonymous'\): PUT /api/queues/made-here .*"
                     r"done \(201\)", log), log[-3000:]
    assert re.search(r"management change by 127\.0\.0\.1:\d+ \(user 'anonymous'\): POST /api/bindings .*"
                     r"done \(201\)", log), log[-3000:]


def test_each_connection_shows_its_protocol(daemon, browser):
    d = daemon
    ok(config(d, "add", "queue", "protocols-q"))
    receiver = subprocess.Popen(command("qflow-receive") + ["-b", d.address, "-a", "protocols-q", "--forever",
                                                            "--connection-name", "native"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    container = Container()
    container.container_id = "proton-client"
    amqp = BlockingConnection(d.address, timeout=DEADLINE, container=container)
    page = browser.new_page()
    try:
        peers = until("both connections", lambda: (lambda seen: len(seen) == 2 and seen)(
            {c["name"]: (c["peer"], c["protocol"]) for c in api(d, "/api/connections")
             if c["name"] in ("native", "proton-client")}))
        assert {name: protocol for name, (_, protocol) in peers.items()} == {"native": "qflow",
                                                                           "proton-client": "amqp1.0"}
        page.goto(f"http://127.0.0.1:{d.mgmt_port}/", timeout=DEADLINE * MS)
        for peer, protocol in peers.values():
            expect(page.locator(f'#connections tr[data-connection="{peer}"] td.protocol').first).to_have_text(
                protocol, timeout=DEADLINE * MS)
    finally:
        page.close()
        amqp.close()
        receiver.kill()
        receiver.communicate()
    ok(config(d, "del", "queue", "protocols-q", "--force"))
