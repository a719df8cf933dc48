"""The journal's batch encoder in C (native/journal.c, qflow.store.journal
encode_native) makes exactly the bytes of its Python twin (encode_python),
which makes the layout docs/store.md and the journal's doc describe: the
on-disk format did not change when the encoding moved to C, and journals
written before recover as they did."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qflow.protocol.entries import ENTRY_HEAD, REDELIVERED_NO, encode_tail, redelivered
from qflow.store.journal import (
    REC_DELETE,
    REC_DEQUEUE,
    REC_ENQUEUE,
    Journal,
    JournalError,
    _apply_batch,
    encode_native,
    encode_python,
    encoder_for,
)
from tests.conftest import examples


def entry(seq: int, body: bytes, queue: str, props: dict | None = None) -> bytes:
    tail = encode_tail("amq.fanout", queue, props if props is not None else {"durable": True}, body)
    return ENTRY_HEAD.pack(REDELIVERED_NO, 0xCF, seq, 0xCF, len(body) + 7) + tail


def staged_journal(tmp_path) -> Journal:
    j = Journal(tmp_path)
    j.recover()
    return j


def test_a_known_batch_is_encoded_byte_for_byte_as_the_format_says(tmp_path):
    """One run of two messages on "q", one on "é" and "q" (fanout: one body), a
    dequeue and a delete, laid out by hand from the format: both encoders agree."""
    j = staged_journal(tmp_path)
    a, b = entry(1, b"one", "q"), entry(2, b"", "q")
    j.enqueue_run("q", [a, b])
    fan = [("é", entry(1, b"fan", "é")), ("q", entry(3, b"fan", "é"))]
    j.enqueue_fanout(fan)
    j.dequeue("q", 1)
    j.delete_queue("é")
    batch = j.take_staged()
    tails = [e[19:] for e in (a, b, fan[0][1])]
    expected = b"".join([
        struct.pack("<BI", 2, 2), struct.pack("<H", 1), b"q", struct.pack("<H", 2), "é".encode(),
        struct.pack("<I", 3), *(struct.pack("<QI", size, len(t)) for size, t in zip((10, 7, 10), tails, strict=True)),
        struct.pack("<I", 3),
        struct.pack("<BI", REC_ENQUEUE, 4), struct.pack("<IQI", 0, 1, 0), struct.pack("<IQI", 0, 2, 1),
        struct.pack("<IQI", 1, 1, 2), struct.pack("<IQI", 0, 3, 2),
        struct.pack("<BI", REC_DEQUEUE, 1), struct.pack("<IQ", 0, 1),
        struct.pack("<BI", REC_DELETE, 1), struct.pack("<I", 1),
        *tails])
    assert encode_python(batch) == expected
    assert bytes(encode_native(batch)) == expected
    assert batch.payload_size() == len(expected)


def test_inconsistent_columns_are_refused_with_a_clear_error(tmp_path):
    """A batch whose body names no enqueue item is a bug: the C encoder
    writes nothing and the writer raises, naming the encoder's answer
    (the journal then refuses further commits, as after any failed write)."""
    j = staged_journal(tmp_path)
    j.enqueue_run("q", [entry(1, b"x", "q")])
    batch = j.take_staged()
    batch.body_entries[0] = 5
    with pytest.raises(JournalError, match="batch encoder returned -2"):
        encode_native(batch)
    batch.body_entries[0] = 0
    batch.enq_bodies.append(0)
    with pytest.raises(JournalError, match="columns differ in length"):
        encode_native(batch)


def test_qflow_accounting_python_selects_the_python_twin(monkeypatch):
    monkeypatch.setenv("QFLOW_ACCOUNTING", "python")
    assert encoder_for() is encode_python
    monkeypatch.setenv("QFLOW_ACCOUNTING", "native")
    assert encoder_for() is encode_native


QUEUES = ["q", "queue-2", "ünï", "x" * 200]
bodies = st.binary(max_size=300) | st.integers(0, 70_000).map(lambda n: b"z" * n)
props = st.none() | st.just({"durable": True}) | st.dictionaries(st.text(max_size=5), st.integers(-2**63, 2**63 - 1), max_size=3)
step = st.one_of(
    st.tuples(st.just("run"), st.sampled_from(QUEUES), st.lists(st.tuples(bodies, props), max_size=20)),
    st.tuples(st.just("fanout"), st.lists(st.sampled_from(QUEUES), min_size=1, max_size=4, unique=True),
              st.tuples(bodies, props)),
    st.tuples(st.just("dequeue"), st.sampled_from(QUEUES), st.integers(0, 30)),
    st.tuples(st.just("delete"), st.sampled_from(QUEUES), st.none()),
)


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=25))
def test_records_encoded_in_c_are_the_python_encoders_bytes_and_decode_to_what_was_staged(tmp_path_factory, steps):
    """Random staging (runs, fanouts, dequeues, deletes, on queues with
    non-ASCII and long names, bodies up to 70 kB): C and Python make the same
    bytes, of the size the journal placed, and the recovery's decoder reads
    them back as the staged operations."""
    j = staged_journal(tmp_path_factory.mktemp("j"))
    next_seq = dict.fromkeys(QUEUES, 1)
    live: dict[str, list[int]] = {q: [] for q in QUEUES}
    for kind, q, arg in steps:
        if kind == "run":
            run = []
            for body, p in arg:
                run.append(entry(next_seq[q], body, q, p))
                live[q].append(next_seq[q])
                next_seq[q] += 1
            j.enqueue_run(q, run)
        elif kind == "fanout":
            body, p = arg
            placements = []
            for name in q:
                placements.append((name, entry(next_seq[name], body, q[0], p)))
                live[name].append(next_seq[name])
                next_seq[name] += 1
            j.enqueue_fanout(placements)
        elif kind == "dequeue":
            gone, live[q] = live[q][:arg], live[q][arg:]
            for seq in gone:
                assert j.dequeue(q, seq)
        else:
            j.delete_queue(q)
            live[q] = []
    batch = j.take_staged()
    if batch is None:
        return
    python = encode_python(batch)
    assert bytes(encode_native(batch)) == python
    assert len(python) == batch.payload_size()
    state: dict = {}
    _apply_batch(memoryview(python), 1, state)
    expected: dict = {}
    for op, items in batch.sections:
        for item in items:
            name = batch.names[item[0]]
            if op == REC_ENQUEUE:
                size, e = batch.bodies[item[2]]
                expected.setdefault(name, {})[item[1]] = redelivered(
                    e[:2] + item[1].to_bytes(8, "big") + e[10:11] + size.to_bytes(8, "big") + e[19:])
            elif op == REC_DEQUEUE:
                expected.get(name, {}).pop(item[1], None)
            else:
                expected.pop(name, None)
    assert {q: {s: e for s, (_, e) in m.items()} for q, m in state.items()} == expected
