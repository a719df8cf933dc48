"""Unroutable messages are counted, per exchange and broker-wide, as qpidd
counts them (an exchange's msgReceives, msgRoutes, msgDrops; the broker's
discardsNoRoute), and shown by the API, the metrics and ``qflow-stat -e``.

An unroutable transfer is still completed and discarded (qpidd does the
same); what changed is that it no longer vanishes without a trace.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import qflow
from qflow.management.views import broker_view, exchange_view
from qflow.protocol import spec as P
from qflow.protocol.entries import encode_tail, message_size
from qflow.testing import Harness
from tests.conftest import Daemon

BIN = Path(sys.executable).parent
DEADLINE = 60.0


def size_of(exchange: str, key: str, body: bytes) -> int:
    return message_size(len(encode_tail(exchange, key, None, body)), len(body))


def _exchange(h: Harness, name: str) -> dict:
    return exchange_view(h.broker.exchanges[name])


@pytest.mark.parametrize("transfer_runs", [True, False], ids=["runs", "frame-by-frame"])
def test_counts_routed_and_dropped_both_paths(transfer_runs: bool) -> None:
    h = Harness(transfer_runs=transfer_runs)
    client = h.connect("counter")
    s = client.session()
    s.declare_queue("a")
    s.declare_queue("b")
    s.call(P.EXCHANGE_BIND, "amq.fanout", "a", "")
    s.call(P.EXCHANGE_BIND, "amq.fanout", "b", "")
    size = size_of("amq.fanout", "", b"xyz")
    for _ in range(3):  # a fanout to two queues: each message routed twice
        s.transfer("", b"xyz", exchange="amq.fanout")
    for _ in range(2):  # a direct exchange with no binding for the key: dropped
        s.transfer("nobody", b"xyz", exchange="amq.direct")
    s.transfer("missing", b"xyz")  # the default exchange, no such queue: dropped
    s.transfer("a", b"xyz")  # the default exchange, routed once
    h.run()
    fan = _exchange(h, "amq.fanout")
    assert (fan["msgReceives"], fan["msgRoutes"], fan["msgDrops"]) == (3, 6, 0)
    assert (fan["byteReceives"], fan["byteRoutes"], fan["byteDrops"]) == (3 * size, 6 * size, 0)
    direct = _exchange(h, "amq.direct")
    dsize = size_of("amq.direct", "nobody", b"xyz")
    assert (direct["msgReceives"], direct["msgRoutes"], direct["msgDrops"]) == (2, 0, 2)
    assert (direct["byteReceives"], direct["byteDrops"]) == (2 * dsize, 2 * dsize)
    default = _exchange(h, "")
    assert (default["msgReceives"], default["msgRoutes"], default["msgDrops"]) == (2, 1, 1)
    assert default["byteDrops"] == size_of("", "missing", b"xyz")
    totals = broker_view(h.broker, None, {}, 0.0, 1.0)["totals"]
    assert totals["discardsNoRoute"] == 3


def test_a_refused_transfer_is_not_counted_as_routed() -> None:
    h = Harness()
    s = h.connect().session()
    s.declare_queue("full", {"qpid.max_count": 1, "qpid.flow_stop_count": 0})
    s.transfer("full", b"1")
    s.transfer("full", b"2")  # refused: the queue is full
    h.run()
    default = _exchange(h, "")
    assert (default["msgReceives"], default["msgRoutes"], default["msgDrops"]) == (1, 1, 0)



def _get(d: Daemon, path: str) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}{path}", timeout=DEADLINE) as response:
        return response.read()


async def test_unroutable_end_to_end(daemon: Daemon) -> None:
    d = daemon
    async with qflow.open_connection("127.0.0.1", d.port) as conn:
        ssn = await conn.session()
        await ssn.declare_exchange("orders.events", "topic")
        sender = ssn.sender("orders.events/eu.created", capacity=50)
        await sender.send_many([b"e"] * 40)  # a run of transfers, bound nowhere
        await sender.send(b"one more")
        await sender.sync()  # completed, though dropped: the sender is never held by a dropped message
    exchanges = {e["name"]: e for e in json.loads(_get(d, "/api/exchanges"))}
    ev = exchanges["orders.events"]
    assert (ev["msgReceives"], ev["msgRoutes"], ev["msgDrops"]) == (41, 0, 41)
    assert ev["byteDrops"] == ev["byteReceives"] > 41
    assert json.loads(_get(d, "/api/broker"))["totals"]["discardsNoRoute"] >= 41

    samples = {(s.name, s.labels.get("exchange")): s.value
               for family in text_string_to_metric_families(_get(d, "/metrics").decode())
               for s in family.samples}
    assert samples[("qflow_exchange_messages_dropped_total", "orders.events")] == 41
    assert samples[("qflow_exchange_messages_received_total", "orders.events")] == 41
    assert samples[("qflow_unroutable_messages_total", None)] >= 41

    out = subprocess.run([str(BIN / "qflow-stat"), "-b", f"127.0.0.1:{d.port}", "-e"], capture_output=True,
                         text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split() == ["exchange", "type", "dur", "bind", "msgIn", "msgOut", "msgDrop", "byteIn",
                                "byteOut", "byteDrop"]
    (row,) = [line.split() for line in lines if line.startswith("orders.events ")]
    # dur is blank (not durable): count the statistics from the right
    assert row[:2] == ["orders.events", "topic"] and row[-6:-3] == ["41", "0", "41"]
