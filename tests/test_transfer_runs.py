"""Runs of transfers taken whole by C (qflow.broker.transfer_runs) leave the
broker exactly as the frame-by-frame path does: the same queue entries, the
same accounting, the same holds given to outside holders, the same bytes
written to every connection (completions, exceptions, deliveries), however
the stream is split into reads."""

from __future__ import annotations

import msgpack
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qflow import protocol as P
from qflow.broker import Broker
from qflow.broker.transfer_runs import TransferRuns  # built by make install, as the accounting is
from qflow.protocol.framing import PROTOCOL_HEADER, READ_SIZE
from qflow.server import pump as server
from qflow.server.pump import ConnectionPump

pytestmark = pytest.mark.native_only  # the accounting is the same either way; once is enough

pack = msgpack.Packer(use_bin_type=True).pack


def _setup_frames() -> bytes:
    frames = [
        [P.OPEN, {"mechanism": "ANONYMOUS"}], [P.ATTACH, 0, "p"], [P.ATTACH, 1, "c"],
        [P.QUEUE_DECLARE, 0, "a", False, False, False, {}, False],
        # reject at 3 messages, flow stops at 2: holds, then refusals
        [P.QUEUE_DECLARE, 0, "b", False, False, False,
         {"qpid.max_count": 3, "qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1}, False],
        [P.QUEUE_DECLARE, 0, "r", False, False, False, {"qpid.max_count": 4, "qpid.policy_type": "ring"}, False],
        [P.QUEUE_DECLARE, 0, "s", False, False, False, {"qpid.max_size": 200}, False],
        [P.EXCHANGE_BIND, 0, "amq.direct", "a", "k"],
        # flow stops at 3: a fanout run's transfers are held, and released as h is accepted from
        [P.QUEUE_DECLARE, 0, "h", False, False, False, {"qpid.flow_stop_count": 3, "qpid.flow_resume_count": 1},
         False],
        [P.EXCHANGE_BIND, 0, "amq.fanout", "a", ""], [P.EXCHANGE_BIND, 0, "amq.fanout", "r", ""],
        [P.EXCHANGE_BIND, 0, "amq.fanout", "h", ""],
        [P.SUBSCRIBE, 1, "a", "d", P.ACCEPT_EXPLICIT, P.ACQUIRE_PRE_ACQUIRED, 0], [P.FLOW, 1, "d", 7, -1],
        [P.SUBSCRIBE, 1, "h", "e", P.ACCEPT_EXPLICIT, P.ACQUIRE_PRE_ACQUIRED, 0], [P.FLOW, 1, "e", 2, -1],
    ]
    return PROTOCOL_HEADER + b"".join(pack(f) for f in frames)


class _CountingRuns:
    """TransferRuns, counting the runs it finds."""

    def __init__(self, runs: TransferRuns) -> None:
        self._runs = runs
        self.run = runs.run
        self.store = runs.store
        self.fanout_ops = runs.fanout_ops
        self.found = 0

    def scan(self, *args):
        n = self._runs.scan(*args)
        self.found += n > 0
        return n


def _feed(conn: ConnectionPump, data: bytes) -> None:
    conn.receive(data, 0.0)


def _run_broker(runs: bool, chunks: list[bytes]) -> dict:
    """Feed ``chunks`` (after the set-up frames) to a broker; what it holds and wrote."""

    async def go() -> dict:
        broker = Broker(transfer_runs=runs)
        assert (broker.runs is not None) == runs
        if runs:
            broker.runs = _CountingRuns(broker.runs)
        conn = ConnectionPump(broker, 1 << 20, 0.0)
        _feed(conn, _setup_frames())
        # Outside holders: "store" on a (direct and fanout routes) and h (stopped, fanout), "disk" on s
        # and a (a transfer to a is held by both). Each read's holds are released after the next read.
        store, disk = broker.add_holder("store"), broker.add_holder("disk")
        for name, holder in (("a", store), ("h", store), ("s", disk), ("a", disk)):
            broker.queues[name].add_holder(holder)
        given = {store: [], disk: []}
        to_release: list[tuple] = []
        written = [conn.encoder.take()]
        for chunk in chunks:
            for i in range(0, len(chunk), READ_SIZE):  # no read is larger, as in qflowd
                _feed(conn, chunk[i:i + READ_SIZE])
                for holder, held in to_release:
                    holder.release(token for token, _ in held)
                broker.flush()
                to_release = [(holder, holder.take()) for holder in (store, disk)]
                for holder, held in to_release:
                    given[holder] += [(t, [(q.name, e) for q, e in messages]) for t, messages in held]
                written.append(conn.encoder.take())
        queues = {name: (list(q.entries), q.count, q.nbytes, q.next_seq, q.discards_overflow, q.discards_ring, q.stats(),
                         broker.acct.stats(q.slot), sorted(q.flow.tokens))
                  for name, q in broker.queues.items()}
        sessions = {ch: (s.commands.next_id, s.commands.floor, s.next_delivery) for ch, s in conn.sessions.items()}
        holders = {h.name: (given[h], broker.acct.stats(h.slot)) for h in (store, disk)}
        return {"queues": queues, "sessions": sessions, "holders": holders, "written": b"".join(written),
                "scanned_runs": broker.runs.found if runs else 0}

    return trio.run(go)


def _transfer(channel: int, exchange: str, key: str, props: dict | None, body: bytes) -> bytes:
    return pack([P.TRANSFER, channel, exchange, key, props, body])


PROPS = [None, None, {"message_id": "m"}, {"bogus": 1}, {"headers": {"x": [1, 2]}}]
frame_st = st.one_of(
    st.builds(_transfer, st.sampled_from([0, 0, 1]), st.sampled_from(["", "", "amq.direct", "amq.fanout", "nope"]),
              st.sampled_from(["a", "a", "b", "r", "s", "k", "none"]), st.sampled_from(PROPS),
              st.sampled_from([b"", b"x" * 3, b"y" * 64, b"z" * 300, b"w" * 70_000])),
    st.sampled_from([pack([P.SYNC, 0]), pack([P.FLUSH, 0]), pack([P.FLOW, 1, "d", 3, -1]),
                     pack([P.FLOW, 1, "e", 2, -1]), pack([P.ACCEPT, 1, [0, 2]]), pack([P.ACCEPT, 1, [0, 40]])]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(frame_st, st.integers(1, 12)), max_size=40), st.data())
def test_runs_change_nothing_but_speed(items, data):
    frames = b"".join(f * n for f, n in items)  # repeats make runs
    cuts = sorted(data.draw(st.lists(st.integers(0, len(frames)), max_size=4)))
    chunks = [frames[a:b] for a, b in zip([0, *cuts], [*cuts, len(frames)], strict=True) if b > a]
    # Look for a run at every frame, not only after RUN_RETRY frames without one.
    retry, server.RUN_RETRY = server.RUN_RETRY, data.draw(st.sampled_from([0, server.RUN_RETRY]))
    try:
        with_runs = _run_broker(True, chunks)
    finally:
        server.RUN_RETRY = retry
    without = _run_broker(False, chunks)
    del with_runs["scanned_runs"], without["scanned_runs"]
    assert with_runs == without


def test_a_run_is_cut_where_the_queue_is_full():
    """Qpid's reject policy, by example: a queue limited to 3 messages takes
    3 of a run of 5 (C stores those) and refuses the other 2, one exception each."""
    body = b"m" * 10
    chunk = _transfer(0, "", "b", None, body) * 5
    runs, frames = _run_broker(True, [chunk]), _run_broker(False, [chunk])
    assert runs.pop("scanned_runs") >= 1  # the run was taken (then the full queue's refusals the usual way)
    frames.pop("scanned_runs")
    assert runs == frames
    entries, count, nbytes, next_seq, discards, *_ = runs["queues"]["b"]
    assert (count, nbytes, next_seq, discards) == (3, 30, 4, 2)
    assert [e[19:] for e in entries] == [_transfer(0, "", "b", None, body)[3:]] * 3


def _scan(data: bytes, max_frame: int = 1 << 20) -> tuple[int, int]:
    r = TransferRuns()
    n = r.scan(data, 0, max_frame)
    return n, (r.run.end if n else 0)


def test_scan_finds_the_run_and_stops_where_it_ends():
    t = _transfer(0, "", "q", None, b"abc")
    assert _scan(t * 3) == (3, 3 * len(t))
    other_key = _transfer(0, "", "q2", None, b"abc")
    assert _scan(t * 2 + other_key + t) == (2, 2 * len(t))
    other_channel = _transfer(1, "", "q", None, b"abc")
    assert _scan(t + other_channel) == (1, len(t))
    assert _scan(t * 2 + t[:-1]) == (2, 2 * len(t))  # the incomplete frame is left to the decoder
    assert _scan(t + pack([P.SYNC, 0])) == (1, len(t))


def test_scan_reads_every_length_encoding():
    long_name = "e" * 40  # str8
    wide = "k" * 300  # str16
    for body in (b"", b"b" * 255, b"b" * 256, b"b" * 70_000):  # bin8, bin16, bin32
        t = _transfer(0, long_name, wide, {"headers": {"h": {"n": [1, 2.5, -3, None, True]}}}, body)
        assert _scan(t * 2) == (2, 2 * len(t))


@pytest.mark.parametrize("frame, why", [
    (_transfer(200, "", "q", None, b"x"), "channel not a fixint"),
    (_transfer(0, "", "q", None, b"x").replace(b"\xc4\x01x", b"\xa1x"), "body a str"),
    (b"\x96\x1e\x00\xa0\xa1q\xd4\x01\x00\xc4\x01x", "properties an ext"),
    (b"\x96\x1e\x00\xa0\xa1q\x81\xc1\xc0\xc4\x01x", "properties holding 0xc1"),
    (b"\x97\x1e\x00\xa0\xa1q\xc0\xc4\x01x\xc0", "seven fields"),
    (b"\x96\x1e\x00\x01\xa1q\xc0\xc4\x01x", "exchange an int"),
    (b"\x96\x1e\x00\xa0\xa1q\xc0", "no body yet"),
])
def test_scan_leaves_any_other_frame_to_the_decoder(frame, why):
    assert _scan(frame) == (0, 0), why


def test_scan_stops_before_a_frame_over_the_limit():
    small, big = _transfer(0, "", "q", None, b"s"), _transfer(0, "", "q", None, b"b" * 5000)
    assert _scan(small + big, max_frame=4096) == (1, len(small))


def test_a_run_to_a_fanout_is_taken_whole():
    """A run to amq.fanout (bound to queue a, and to the ring queue r with
    room for 4): stored for both queues at once, the rest of the run, once r
    is full, the usual way; the broker ends exactly as frame by frame."""
    chunk = _transfer(0, "amq.fanout", "", None, b"f" * 20) * 3 + _transfer(0, "amq.fanout", "", None, b"g" * 20) * 9
    runs, frames = _run_broker(True, [chunk]), _run_broker(False, [chunk])
    assert runs.pop("scanned_runs") >= 1
    frames.pop("scanned_runs")
    assert runs == frames
    assert runs["queues"]["r"][1] == 4 and runs["queues"]["h"][8]  # r full, h holding transfers
    # one hold per holder per transfer: the store's covers both a and h, the disk's only a
    store, disk = runs["holders"]["store"][0], runs["holders"]["disk"][0]
    assert len(store) == len(disk) == 12
    assert [q for q, _ in store[0][1]] == ["a", "h"] and [q for q, _ in disk[0][1]] == ["a"]
