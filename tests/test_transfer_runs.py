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
from qflow.protocol import entries as E
from qflow.protocol.framing import PROTOCOL_HEADER, READ_SIZE
from qflow.protocol.names import name_problem
from qflow.server import pump as server
from qflow.server.pump import ConnectionPump
from tests.conftest import examples, stats_but_incarnation

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
        queues = {name: (list(q.entries), q.count, q.nbytes, q.next_seq, q.discards_overflow, q.discards_ring, stats_but_incarnation(q),
                         broker.acct.stats(q.slot), sorted(broker.completion.held_tokens(q)))
                  for name, q in broker.queues.items()}
        sessions = {ch: (s.commands.next_id, s.commands.floor, s.next_delivery) for ch, s in conn.sessions.items()}
        holders = {h.name: (given[h], broker.acct.stats(h.slot)) for h in (store, disk)}
        return {"queues": queues, "sessions": sessions, "holders": holders, "written": b"".join(written),
                "scanned_runs": broker.runs.found if runs else 0}

    return trio.run(go)


def _transfer(channel: int, exchange: str, key: str, props: dict | None, body: bytes) -> bytes:
    return pack([P.TRANSFER, channel, exchange, key, props, body])


PROPS = [None, None, {"message_id": "m"}, {"bogus": 1}, {"headers": {"x": [1, 2]}}]
# Ids a run may vary in (ASCII fixstr and str8), and ids that end one (not ASCII: the
# Python decoder checks its UTF-8; str16; nil; an int, which the broker refuses).
IDS = ["", "w-0-1", "w-0-22", "i" * 40, "é1", "k" * 300, None, 7]
ID_REST = [{}, {"durable": True}, {"content_type": "t", "headers": {"h": 1}}, {"bogus": 2}]


def _id_burst(channel: int, exchange: str, key: str, rest: dict, ids: list, body: bytes) -> bytes:
    """Transfers that differ only in their message id (the map's first key), back to back."""
    return b"".join(_transfer(channel, exchange, key, {"message_id": i, **rest}, body) for i in ids)


frame_st = st.one_of(
    st.builds(_transfer, st.sampled_from([0, 0, 1]), st.sampled_from(["", "", "amq.direct", "amq.fanout", "nope"]),
              st.sampled_from(["a", "a", "b", "r", "s", "k", "none"]), st.sampled_from(PROPS),
              st.sampled_from([b"", b"x" * 3, b"y" * 64, b"z" * 300, b"w" * 70_000])),
    st.builds(_id_burst, st.sampled_from([0, 0, 1]), st.sampled_from(["", "", "amq.fanout"]),
              st.sampled_from(["a", "b", "r", "s", "h"]), st.sampled_from(ID_REST),
              st.lists(st.sampled_from(IDS), min_size=1, max_size=6), st.sampled_from([b"", b"y" * 64, b"z" * 300])),
    st.sampled_from([pack([P.SYNC, 0]), pack([P.FLUSH, 0]), pack([P.FLOW, 1, "d", 3, -1]),
                     pack([P.FLOW, 1, "e", 2, -1]), pack([P.ACCEPT, 1, [0, 2]]), pack([P.ACCEPT, 1, [0, 40]])]),
)


def _same_with_and_without_runs(frames: bytes, cuts: list[int], run_retry: int) -> None:
    chunks = [frames[a:b] for a, b in zip([0, *cuts], [*cuts, len(frames)], strict=True) if b > a]
    retry, server.RUN_RETRY = server.RUN_RETRY, run_retry
    try:
        with_runs = _run_broker(True, chunks)
    finally:
        server.RUN_RETRY = retry
    without = _run_broker(False, chunks)
    del with_runs["scanned_runs"], without["scanned_runs"]
    assert with_runs == without


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(frame_st, st.integers(1, 12)), max_size=40), st.data())
def test_runs_change_nothing_but_speed(items, data):
    frames = b"".join(f * n for f, n in items)  # repeats make runs
    cuts = sorted(data.draw(st.lists(st.integers(0, len(frames)), max_size=4)))
    # Look for a run at every frame, not only after RUN_RETRY frames without one.
    _same_with_and_without_runs(frames, cuts, data.draw(st.sampled_from([0, server.RUN_RETRY])))


def test_a_holder_is_told_of_its_holds_in_the_order_the_transfers_arrived():
    """Seed 6's case: holds given as pairs (a mixed log) wait untaken when a
    later apply gives the same holder a uniform run; take() must return the
    pairs first, as the transfers arrived, not the later run."""
    items = [(_transfer(1, "", "b", {"bogus": 1}, b""), 4),
             (_id_burst(0, "", "a", {}, ["w-0-1", ""], b""), 6),
             (pack([P.FLUSH, 0]), 12),
             (_id_burst(0, "", "a", {"durable": True}, ["w-0-1", ""], b""), 1),
             (pack([P.FLOW, 1, "d", 3, -1]), 9),
             (pack([P.SYNC, 0]), 21),
             (_transfer(0, "amq.direct", "k", {"message_id": "m"}, b""), 3),
             (pack([P.SYNC, 0]), 9),
             (_transfer(0, "", "s", None, b""), 2)]
    _same_with_and_without_runs(b"".join(f * n for f, n in items), [], 0)


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
    # A message's size: exchange "" (1 byte), routing key "b" (2), nil properties (1) and the body (10).
    assert (count, nbytes, next_seq, discards) == (3, 3 * 14, 4, 2)
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


def test_scan_takes_transfers_that_differ_only_in_their_message_id_as_one_run():
    """A writer giving each message its own id (for consumers to drop
    duplicates) still sends one run: the frames may differ in the value of
    the properties' first key, message_id, an ASCII str; in nothing else."""
    def t(mid, body=b"abc", **rest):
        return _transfer(0, "", "q", {"message_id": mid, **rest}, body)

    ids = [t(f"w-0-{i}") for i in (1, 22, 333, 4444)]
    assert _scan(b"".join(ids)) == (4, sum(map(len, ids)))
    mixed = [t("a"), t("b" * 31), t("c" * 32), t("d" * 255), t(""), t("e", body=b"x" * 300)]  # fixstr, str8
    assert _scan(b"".join(mixed)) == (6, sum(map(len, mixed)))
    durable = [t(f"{i}", durable=True) for i in range(3)]
    assert _scan(b"".join(durable)) == (3, sum(map(len, durable)))
    for other, why in [(t("b", durable=True), "another property"), (t("é"), "not ASCII"), (t("k" * 256), "a str16"),
                       (t(None), "nil"), (_transfer(0, "", "q2", {"message_id": "b"}, b"abc"), "another key"),
                       (_transfer(0, "", "q", {"durable": False, "message_id": "b"}, b"abc"), "the id not first")]:
        assert _scan(t("a") + other) == (1, len(t("a"))), why
    # Where the first frame's id is not one a run may vary in, none may differ.
    assert _scan(t("é") + t("é") + t("f")) == (2, 2 * len(t("é")))


def test_a_spark_write_batch_with_a_shared_timestamp_is_one_run():
    """The Spark writer's batch: send_many(bodies, message_ids=..., timestamp=T)
    encodes each transfer as the client does (the id the map's first key, the
    batch's send time after it, the same for all). The scanner takes the
    whole batch as one run, with durable and shared headers too; a timestamp
    differing per row ends the run (the writer sends such rows one by one)."""
    from qflow.client.sender import _properties
    from qflow.protocol.encodings import bin_header, str_header, transfer_prefix_around_id

    def frames(ids: list[str], stamps: list[int], durable: bool = False, headers: dict | None = None) -> list[bytes]:
        out = []
        for mid, ts in zip(ids, stamps, strict=True):
            before, after = transfer_prefix_around_id(0, "", "q", _properties(None, None, None, durable, headers, ts))
            body = f"row {mid}".encode()
            out.append(before + str_header(len(mid)) + mid.encode() + after + bin_header(len(body)) + body)
        return out

    now = 1_764_000_000_123  # milliseconds: a uint64 in msgpack
    ids = [f"query-7-0-{i}" for i in range(500)]
    for durable, headers in [(False, None), (True, None), (True, {"source": "orders", "n": 3})]:
        batch = frames(ids, [now] * len(ids), durable, headers)
        assert msgpack.unpackb(batch[0])[4] == {"message_id": ids[0], **({"durable": True} if durable else {}),
                                                 **({"headers": headers} if headers else {}), "timestamp": now}
        assert _scan(b"".join(batch)) == (len(ids), sum(map(len, batch))), (durable, headers)
    differing = frames(ids[:3], [now, now, now + 1])
    assert _scan(b"".join(differing)) == (2, len(differing[0]) + len(differing[1]))


def test_a_run_with_an_id_each_stores_each_message_as_sent_and_sized_so():
    """Each entry is its own transfer's bytes (its own id), each size counts
    its own id's length, and the queue's and the accounting's byte depths are
    their sum, as frame by frame."""
    frames = [_transfer(0, "", "q", {"message_id": "m" * i, "durable": True}, b"x" * 64) for i in range(40)]
    chunk = b"".join(frames)
    sizes, nbytes, acct_bytes, taken = _stored_sizes(True, "", "q", chunk)
    assert taken == 1  # one run, all 40
    expected = [len(f) - 3 - 2 for f in frames]  # after [30, channel], less the bin header
    assert (sizes, nbytes, acct_bytes) == (expected, sum(expected), sum(expected))
    assert _stored_sizes(False, "", "q", chunk)[:3] == (sizes, nbytes, acct_bytes)
    runs, by_frame = _run_broker(True, [b"".join(f.replace(b"\xa1q", b"\xa1a", 1) for f in frames)]), \
        _run_broker(False, [b"".join(f.replace(b"\xa1q", b"\xa1a", 1) for f in frames)])
    assert runs.pop("scanned_runs") >= 1
    by_frame.pop("scanned_runs")
    assert runs == by_frame  # queue a: the same entries, holds (store, disk), completions and deliveries


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


# -- a message's size: the same from a run (C) and frame by frame (Python) ------------------------------------


def _str(text: str, wide: bool) -> bytes:
    """msgpack str; ``wide``: as str8 even where a fixstr would do (valid, one byte more)."""
    raw = text.encode()
    return b"\xd9" + bytes((len(raw),)) + raw if wide and len(raw) < 0x100 else pack(text)


def _bin(body: bytes, width: int) -> bytes:
    """msgpack bin behind a header of at least ``width`` bytes of length (1, 2 or 4)."""
    width = max(width, 1 if len(body) < 0x100 else 2 if len(body) < 0x10000 else 4)
    return bytes((0xC4 + width.bit_length() - 1,)) + len(body).to_bytes(width, "big") + body


header_value = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=20),
                         st.floats(allow_nan=False), st.binary(max_size=20), st.lists(st.integers(-1000, 1000), max_size=3))
properties_st = st.one_of(st.none(), st.fixed_dictionaries({}, optional={
    "message_id": st.text(max_size=40), "correlation_id": st.text(max_size=10), "content_type": st.text(max_size=10),
    "durable": st.booleans(), "headers": st.dictionaries(st.text(max_size=10), header_value, max_size=4)}))
body_st = st.one_of(st.binary(max_size=300), st.sampled_from([b"", b"b" * 255, b"b" * 256, b"b" * 65535,
                                                              b"b" * 65536]))


def _stored_sizes(runs: bool, exchange: str, key: str, frames: bytes) -> tuple[list[int], int, int, int]:
    """Feed ``frames`` (transfers to ``exchange`` with ``key``, bound to queue "q") to a
    broker: (its entries' sizes, the queue's byte depth, the accounting's, runs taken)."""

    async def go() -> tuple[list[int], int, int, int]:
        broker = Broker(transfer_runs=runs)
        if runs:
            broker.runs = _CountingRuns(broker.runs)
        conn = ConnectionPump(broker, 1 << 20, 0.0)
        setup = [[P.OPEN, {"mechanism": "ANONYMOUS"}], [P.ATTACH, 0, "p"],
                 [P.QUEUE_DECLARE, 0, "q", False, False, False, {}, False]]
        if exchange:
            setup += [[P.EXCHANGE_DECLARE, 0, exchange, "direct", False, False], [P.EXCHANGE_BIND, 0, exchange, "q", key]]
        _feed(conn, PROTOCOL_HEADER + b"".join(pack(f) for f in setup))
        _feed(conn, frames)
        written = conn.encoder.take()
        assert P.EXCEPTION not in [f[0] for f in _frames(written)], written
        q = broker.queues["q"]
        return ([E.seq_and_size(e)[1] for e in q.entries], q.nbytes, broker.acct.stats(q.slot)[1],
                broker.runs.found if runs else 0)

    return trio.run(go)


def _frames(data: bytes) -> list:
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(data)
    return list(unpacker)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.just(""), st.text(min_size=1, max_size=30).filter(
    lambda s: not s.startswith("amq.") and name_problem(s) is None)),  # a name an exchange.declare accepts
       st.text(max_size=300), properties_st, body_st, st.booleans(), st.sampled_from([1, 2, 4]),
       st.integers(1, 3))
def test_a_message_has_the_same_size_in_a_run_and_frame_by_frame(exchange, key, props, body, wide, width, n):
    """The rule, for any exchange, routing key, properties and body, encoded as
    msgpack-python does or wider (str8 for short strings, bin16/bin32 for short
    bodies): the size is the bytes of exchange, routing key, properties and body
    as sent, less the bin header msgpack needs for the body (so, as msgpack
    writes them, the fields' bytes plus the body's length), in every entry's
    head, the queue's byte depth and the accounting's, whether C takes the
    transfers as a run or Python one frame at a time."""
    if not exchange:
        key = "q"  # the default exchange routes by queue name
    fields = _str(exchange, wide) + _str(key, wide) + (b"\xc0" if props is None else pack(props))
    encoded_body = _bin(body, width)
    frame = b"\x96\x1e\x00" + fields + encoded_body
    size = len(fields) + len(encoded_body) - (len(_bin(body, 1)) - len(body))  # less the minimal header
    if not wide and width == 1:
        assert size == len(fields) + len(body)
    sizes, nbytes, acct_bytes, taken = _stored_sizes(True, exchange, key, frame * n)
    assert taken >= 1  # C took the run
    assert (sizes, nbytes, acct_bytes) == ([size] * n, size * n, size * n)
    assert _stored_sizes(False, exchange, key, frame * n)[:3] == (sizes, nbytes, acct_bytes)


def test_a_transfer_with_another_head_is_stored_re_encoded_and_sized_so():
    """A transfer whose array is an array16 (valid msgpack, not the usual head) is
    stored as msgpack re-encodes it, since its bytes after [30, channel] cannot be
    cut out as they are: its size counts the re-encoded fields (fixstr "" 1, fixstr
    "q" 2, nil 1), not the wider ones sent (str8 "" 2, str8 "q" 3, nil 1)."""
    fields = _str("", True) + _str("q", True) + b"\xc0"
    frame = b"\xdc\x00\x06\x1e\x00" + fields + _bin(b"abc", 2)
    for runs in (True, False):
        assert _stored_sizes(runs, "", "q", frame * 2)[:3] == ([4 + 3] * 2, 14, 14)
