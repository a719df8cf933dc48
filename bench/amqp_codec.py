"""The AMQP 1.0 engine's own cost per message on the server side, no sockets:
python-qpid-proton's engine against qflow's core (qflow/protocol/amqp), on the
same bytes, interleaved in one run (bench/README.md: only ratios in one run mean
anything).

    .venv/bin/python bench/amqp_codec.py [--messages 20000] [--rounds 5]

Setup: a proton client (its engine, in process) attaches a sender and sends
``--messages`` messages (64 B and 1 KiB bodies, unsettled); its bytes are
captured once. Then, per round, for each side:

* inbound (a producer's bytes into the broker): a fresh server-side
  connection is fed the setup bytes and answers them (open, begin, attach,
  credit for all), then the timed part: the transfer bytes pushed in 256 KiB
  reads, every delivery read whole and answered accepted + settled, the
  output taken.
  - proton: ``Transport.push``, ``Collector`` events, ``Link.recv``,
    ``Delivery.update(ACCEPTED)``, ``settle``, ``Transport.peek/pop``.
  - qflow: ``Connection.receive_data`` (transfer events with the payload),
    ``Connection.disposition`` per delivery, ``data_to_send``.
  qflow's decode alone (without the dispositions), and settling by ranges
  (one disposition per run of consecutive ids, as a broker settles a batch
  of completions) are shown too, and the decode with the C scanner's Python
  twin (what the extension buys).
* outbound (the broker delivering to a consumer): ``--messages`` transfers
  written to a receiving peer's link that has credit for all, output taken.
  - proton: ``Link.delivery``, ``send``, ``advance``, ``Transport.peek/pop``.
  - qflow: ``Connection.transfer``, ``data_to_send``; and
    ``Connection.transfer_many`` in batches of 1000.

Reported: the median µs per message of each, and the ratios proton ÷ qflow
(above 1: qflow is cheaper). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import proton
from proton import Collector, Event, Message, Transport

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from qflow.protocol.amqp import events as ev  # noqa: E402
from qflow.protocol.amqp.connection import Connection  # noqa: E402
from qflow.protocol.amqp.performatives import Source, Target  # noqa: E402
from qflow.protocol.amqp.transfer_runs import ROW, TransferRun  # noqa: E402

READ = 256 * 1024


def spin_loop() -> float:
    t = time.perf_counter()
    x = 0
    for i in range(3_000_000):
        x += i
    return time.perf_counter() - t


def drain(transport: Transport) -> bytes:
    out = bytearray()
    while True:
        n = transport.pending()
        if n <= 0:
            return bytes(out)
        out += transport.peek(n)
        transport.pop(n)


def push_all(transport: Transport, data: bytes) -> None:
    view = memoryview(data)
    while view:
        take = min(len(view), max(transport.capacity(), 0))
        if take <= 0:
            drain(transport)
            continue
        transport.push(bytes(view[:take]))
        view = view[take:]


def capture(n: int, body_size: int) -> tuple[bytes, bytes]:
    """A proton producer's bytes: (setup: header, open, begin, attach; the transfers)."""
    client = proton.Connection()
    client.container = "producer"
    t = Transport()
    t.bind(client)
    client.open()
    session = client.session()
    session.open()
    sender = session.sender("producer-link")
    sender.target.address = "q"
    sender.open()
    setup = drain(t)
    server = Connection()
    events = server.receive_data(setup)
    attached = [e for e in events if isinstance(e, ev.LinkAttached)][0]
    server.open()
    server.begin(0)
    server.attach(0, attached.handle, target=attached.target)
    server.flow(0, attached.handle, n)
    push_all(t, server.data_to_send())
    drain(t)
    body = b"m" * body_size
    for i in range(n):
        sender.delivery(str(i).encode())
        sender.send(Message(body=body).encode())
        sender.advance()
    return setup, drain(t)


def proton_inbound(setup: bytes, transfers: bytes, n: int) -> float:
    conn = proton.Connection()
    conn.container = "broker"
    t = Transport(Transport.SERVER)
    t.bind(conn)
    collector = Collector()
    conn.collect(collector)
    push_all(t, setup)
    while collector.peek():
        e = collector.peek()
        if e.type == Event.CONNECTION_REMOTE_OPEN:
            conn.open()
        elif e.type == Event.SESSION_REMOTE_OPEN:
            e.session.open()
        elif e.type == Event.LINK_REMOTE_OPEN:
            link = e.link
            link.target.address = link.remote_target.address
            link.open()
            link.flow(n)
        collector.pop()
    drain(t)
    got = 0
    start = time.perf_counter()
    for i in range(0, len(transfers), READ):
        push_all(t, transfers[i:i + READ])
        while collector.peek():
            e = collector.peek()
            if e.type == Event.DELIVERY:
                d = e.delivery
                if d.readable and not d.partial:
                    link = d.link
                    link.recv(d.pending)
                    link.advance()
                    d.update(proton.Delivery.ACCEPTED)
                    d.settle()
                    got += 1
            collector.pop()
        drain(t)
    elapsed = time.perf_counter() - start
    assert got == n, (got, n)
    return elapsed


def ours_inbound(setup: bytes, transfers: bytes, n: int, dispositions: str = "each", native: bool = True) -> float:
    """``dispositions``: "each" (one frame per delivery), "ranges" (one per run
    of consecutive delivery-ids, as a broker settles a batch), "none" (decode alone)."""
    conn = Connection(native_scan=native)
    events = conn.receive_data(setup)
    attached = [e for e in events if isinstance(e, ev.LinkAttached)][0]
    conn.open()
    conn.begin(0)
    conn.attach(0, attached.handle, target=attached.target)
    conn.flow(0, attached.handle, n)
    conn.data_to_send()
    got = 0
    receive, disposition, run_event = conn.receive_data, conn.disposition, TransferRun
    start = time.perf_counter()
    for i in range(0, len(transfers), READ):
        for e in receive(transfers[i:i + READ]):
            if type(e) is run_event:
                rows = e.rows
                got += e.count
                # What a broker does per delivery at the least: take its payload; then settle each.
                payload = e.payload
                for j in range(e.count):
                    payload(j)
                    if dispositions == "each":
                        disposition(0, rows[ROW * j])
                if dispositions == "ranges":
                    first = prev = rows[0]
                    for j in range(1, e.count):
                        did = rows[ROW * j]
                        if did != prev + 1:
                            disposition(0, first, prev)
                            first = did
                        prev = did
                    disposition(0, first, prev)
        conn.data_to_send()
    elapsed = time.perf_counter() - start
    assert got == n, (got, n)
    return elapsed


def proton_outbound(payload: bytes, n: int) -> float:
    # A consumer's engine that grants credit; the server side under test sends.
    client = proton.Connection()
    ct = Transport()
    ct.bind(client)
    client.open()
    cs = client.session()
    cs.open()
    receiver = cs.receiver("consumer-link")
    receiver.source.address = "q"
    receiver.open()
    receiver.flow(n)
    conn = proton.Connection()
    t = Transport(Transport.SERVER)
    t.bind(conn)
    collector = Collector()
    conn.collect(collector)
    sender = None
    for _ in range(4):
        push_all(t, drain(ct))
        while collector.peek():
            e = collector.peek()
            if e.type == Event.CONNECTION_REMOTE_OPEN:
                conn.open()
            elif e.type == Event.SESSION_REMOTE_OPEN:
                e.session.open()
            elif e.type == Event.LINK_REMOTE_OPEN:
                sender = e.link
                sender.source.address = "q"
                sender.open()
            collector.pop()
        push_all(ct, drain(t))
    assert sender is not None and sender.credit == n, sender and sender.credit
    start = time.perf_counter()
    for i in range(n):
        sender.delivery(str(i).encode())
        sender.send(payload)
        sender.advance()
        if i % 1000 == 999:
            drain(t)
    drain(t)
    return time.perf_counter() - start


def ours_outbound(payload: bytes, n: int, many: bool = False) -> float:
    from qflow.protocol.amqp.frames import AMQP_HEADER, frame
    from qflow.protocol.amqp.performatives import Attach, Begin, Flow, Open
    conn = Connection()
    conn.receive_data(AMQP_HEADER + frame(0, Open(container_id="consumer")) + frame(0, Begin(
        next_outgoing_id=0, incoming_window=0x7FFFFFFF, outgoing_window=0x7FFFFFFF)) + frame(0, Attach(
            name="consumer-link", handle=0, role=True, source=Source(address="q"), target=Target())))
    conn.open()
    conn.begin(0)
    conn.attach(0, 0, source=Source(address="q"))
    conn.receive_data(frame(0, Flow(next_incoming_id=0, incoming_window=0x7FFFFFFF, next_outgoing_id=0,
                                    outgoing_window=0x7FFFFFFF, handle=0, delivery_count=0, link_credit=n)))
    assert conn.link_credit(0, 0) == n
    conn.data_to_send()
    transfer = conn.transfer
    start = time.perf_counter()
    if many:  # batches of 1000, as a broker hands a consumer a batch
        for i in range(0, n, 1000):
            batch = range(i, min(n, i + 1000))
            conn.transfer_many(0, 0, [payload] * len(batch), [str(j).encode() for j in batch])
            conn.data_to_send()
    else:
        for i in range(n):
            transfer(0, 0, payload, delivery_tag=str(i).encode())
            if i % 1000 == 999:
                conn.data_to_send()
    conn.data_to_send()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = args.messages
    result: dict[str, float] = {"messages": n, "rounds": args.rounds, "spin_loop_s_before": round(spin_loop(), 3)}
    print(f"{'size':>6} {'path':<38} {'proton us/msg':>14} {'qflow us/msg':>13} {'proton/qflow':>13}")
    for size, label in ((64, "64b"), (1024, "1k")):
        setup, transfers = capture(n, size)
        payload = Message(body=b"m" * size).encode()
        samples: dict[str, list[float]] = {k: [] for k in ("p_in", "q_in", "q_rng", "q_dec", "q_py", "p_out", "q_out",
                                                            "q_many")}
        for _ in range(args.rounds):
            samples["p_in"].append(proton_inbound(setup, transfers, n))
            samples["q_in"].append(ours_inbound(setup, transfers, n))
            samples["q_rng"].append(ours_inbound(setup, transfers, n, dispositions="ranges"))
            samples["q_dec"].append(ours_inbound(setup, transfers, n, dispositions="none"))
            samples["q_py"].append(ours_inbound(setup, transfers, n, dispositions="none", native=False))
            samples["p_out"].append(proton_outbound(payload, n))
            samples["q_out"].append(ours_outbound(payload, n))
            samples["q_many"].append(ours_outbound(payload, n, many=True))
        us = {k: statistics.median(v) / n * 1e6 for k, v in samples.items()}
        rows = [("inbound: read + accept/settle each", us["p_in"], us["q_in"]),
                ("inbound: qflow settling by ranges", us["p_in"], us["q_rng"]),
                ("inbound: qflow decode alone", us["p_in"], us["q_dec"]),
                ("inbound: decode, Python scanner", us["p_in"], us["q_py"]),
                ("outbound: transfers written", us["p_out"], us["q_out"]),
                ("outbound: qflow transfer_many", us["p_out"], us["q_many"])]
        for name, p, q in rows:
            print(f"{label:>6} {name:<38} {p:14.2f} {q:13.2f} {p / q:13.1f}")
        result.update({
            f"proton_inbound_us_{label}": round(us["p_in"], 3), f"qflow_inbound_us_{label}": round(us["q_in"], 3),
            f"qflow_decode_us_{label}": round(us["q_dec"], 3), f"qflow_decode_python_us_{label}": round(us["q_py"], 3), f"qflow_inbound_ranges_us_{label}": round(us["q_rng"], 3), f"proton_outbound_us_{label}": round(us["p_out"], 3),
            f"qflow_outbound_us_{label}": round(us["q_out"], 3),
            f"qflow_outbound_many_us_{label}": round(us["q_many"], 3),
            f"inbound_proton_over_qflow_{label}": round(us["p_in"] / us["q_in"], 2),
            f"outbound_proton_over_qflow_{label}": round(us["p_out"] / us["q_out"], 2),
            f"transfer_bytes_per_msg_{label}": round(len(transfers) / n, 1)})
    result["spin_loop_s_after"] = round(spin_loop(), 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
