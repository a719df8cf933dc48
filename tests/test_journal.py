"""The durable store's message journal (qflow.store.journal, issue 14): what
was committed comes back exactly, in order and marked redelivered; what was
not committed, or was torn, does not; a bad record ends the recovery with
everything before it kept; and the journal's size falls as messages are
removed, even behind a slow queue. Small segments keep it to a few seconds."""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from qflow.protocol.entries import ENTRY_HEAD, REDELIVERED_NO, encode_tail, redelivered, seq_of
from qflow.store.journal import REC_DELETE, REC_ENQUEUE, SUFFIX, Batch, Journal, JournalError
from tests.conftest import examples


def entry(seq: int, body: bytes, queue: str = "q", flag: int = REDELIVERED_NO) -> bytes:
    return ENTRY_HEAD.pack(flag, 0xCF, seq, 0xCF, len(body)) + encode_tail("amq.fanout", queue, {"durable": True},
                                                                          body)


def files_size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*" + SUFFIX))


def opened(d: Path, **kw) -> tuple[Journal, dict[str, list[bytes]]]:
    j = Journal(d, **kw)
    return j, j.recover()


def seqs(state: dict[str, list[bytes]]) -> dict[str, list[int]]:
    return {q: [seq_of(e) for e in es] for q, es in state.items()}


# -- units ----------------------------------------------------------------------------


def test_recovery_rebuilds_the_exact_entries_in_order_marked_redelivered(tmp_path):
    j, got = opened(tmp_path)
    assert got == {}
    sent = {"a": [entry(s, b"x" * s, "a") for s in range(1, 30)], "b": [entry(s, b"y", "b") for s in (5, 6, 7)]}
    for i, e in enumerate(sent["a"]):
        j.enqueue("a", e)
        if i % 7 == 0:
            j.commit()
    for e in sent["b"]:
        j.enqueue("b", e)
    j.commit()
    j.close()
    _, got = opened(tmp_path)
    assert got == {q: [redelivered(e) for e in es] for q, es in sent.items()}
    assert all(e[0] == 0xC3 for es in got.values() for e in es)


def test_staged_but_not_committed_is_not_recovered_and_dequeues_stay_removed(tmp_path):
    j, _ = opened(tmp_path)
    for s in range(1, 11):
        j.enqueue("q", entry(s, b"m"))
    j.commit()
    for s in (1, 2, 5):
        j.dequeue("q", s)
    j.dequeue("q", 99)  # unknown (transient, or gone): ignored
    j.commit()
    j.enqueue("q", entry(11, b"m"))  # never committed
    j.dequeue("q", 3)  # never committed: comes back
    j.close()
    _, got = opened(tmp_path)
    assert seqs(got) == {"q": [3, 4, 6, 7, 8, 9, 10]}


def test_fanout_stores_the_body_once(tmp_path):
    body = os.urandom(20_000)
    j, _ = opened(tmp_path)
    j.enqueue("solo", entry(1, body, "solo"))
    j.commit()
    one = j.size_on_disk()
    j.enqueue_fanout([(f"q{i}", entry(i + 1, body, "fan")) for i in range(8)])
    j.commit()
    fanout = j.size_on_disk() - one
    assert fanout < len(body) + 1000, f"8 queues cost {fanout} bytes for a body of {len(body)}"
    j.close()
    _, got = opened(tmp_path)
    assert seqs(got) == {"solo": [1], **{f"q{i}": [i + 1] for i in range(8)}}
    assert got["q3"][0] == redelivered(entry(4, body, "fan"))


def test_a_deleted_queue_stays_empty_and_its_name_can_be_reused_in_the_same_batch(tmp_path):
    j, _ = opened(tmp_path)
    for s in range(1, 6):
        j.enqueue("q", entry(s, b"old"))
    j.enqueue("other", entry(1, b"o"))
    j.commit()
    j.delete_queue("q")
    j.enqueue("q", entry(1, b"new"))  # redeclared: its numbering starts again
    j.commit()
    j.delete_queue("gone")
    j.close()
    _, got = opened(tmp_path)
    assert got == {"q": [redelivered(entry(1, b"new"))], "other": [redelivered(entry(1, b"o"))]}


def test_staging_needs_recovery_and_one_commit_at_a_time(tmp_path):
    j = Journal(tmp_path)
    with pytest.raises(JournalError, match="recover"):
        j.enqueue("q", entry(1, b"x"))
    j.recover()
    with pytest.raises(JournalError, match="twice"):
        j.recover()
    j.enqueue("q", entry(1, b"x"))
    batch = j.take_staged()
    with pytest.raises(JournalError, match="in flight"):
        j.take_staged()
    j.write_and_sync(batch)
    j.committed(batch)
    assert j.take_staged() is None
    with pytest.raises(ValueError, match="segment_size"):
        Journal(tmp_path, segment_size=10)


def test_the_loop_stages_the_next_batch_while_a_worker_syncs(tmp_path):
    """The hand-over: the batch taken belongs to the writer; staging goes on beside it."""
    j, _ = opened(tmp_path, segment_size=2048)
    for s in range(1, 50):
        j.enqueue("q", entry(s, b"a" * 40))
    batch = j.take_staged()
    worker = threading.Thread(target=j.write_and_sync, args=(batch,))
    worker.start()
    for s in range(50, 100):
        j.enqueue("q", entry(s, b"b" * 40))
    for s in range(1, 20):
        j.dequeue("q", s)
    worker.join()
    j.committed(batch)
    j.commit()
    j.close()
    _, got = opened(tmp_path)
    assert seqs(got) == {"q": list(range(20, 100))}


def test_size_on_disk_is_the_files_and_falls_to_nothing_live_after_a_drain(tmp_path):
    j, _ = opened(tmp_path, segment_size=4096)
    for s in range(1, 400):
        j.enqueue("q", entry(s, b"z" * 50))
        if s % 20 == 0:
            j.commit()
            assert j.size_on_disk() == files_size(tmp_path)
    j.commit()
    full = j.size_on_disk()
    assert full > 10 * 4096
    for s in range(1, 400):
        j.dequeue("q", s)
        if s % 20 == 0:
            j.commit()
            assert j.size_on_disk() == files_size(tmp_path)
    j.commit()
    # The last segment, dead and over 1/8 full, was rolled over: what is left is a header and the last dequeues.
    assert j.size_on_disk() == files_size(tmp_path) <= 4096 // 8
    j.close()
    _, got = opened(tmp_path, segment_size=4096)
    assert got == {}


def test_a_pinned_message_does_not_keep_the_journal_growing(tmp_path):
    """One message never accepted on a slow queue while a fast one streams:
    carry-forward moves it out of the oldest segment, so old segments die."""
    seg = 4096
    j, _ = opened(tmp_path, segment_size=seg, carry_below=0.25)
    j.enqueue("slow", entry(1, b"pinned"))
    peak = 0
    for s in range(1, 3000):
        j.enqueue("fast", entry(s, b"f" * 60))
        if s > 30:
            j.dequeue("fast", s - 30)
        if s % 10 == 0:
            j.commit()
            peak = max(peak, j.size_on_disk())
            assert j.size_on_disk() == files_size(tmp_path)
    for s in range(2970, 3000):
        j.dequeue("fast", s)
    for _ in range(3):
        j.commit()
    wrote = 3000 * 100
    assert peak <= 4 * seg, f"peak {peak} bytes for segments of {seg} ({wrote} bytes written)"
    assert j.size_on_disk() <= 2 * seg
    j.close()
    _, got = opened(tmp_path, segment_size=seg)
    assert got == {"slow": [redelivered(entry(1, b"pinned"))]}


def test_carry_forward_keeps_a_fanout_messages_body_stored_once(tmp_path):
    """"Fanout and topic routing store one copy of the body, whatever the number
    of queues": also after carry-forward moves the message out of its segment."""
    seg = 8192
    j, _ = opened(tmp_path, segment_size=seg, carry_below=0.25)
    body = b"B" * 400  # one fanout message on three durable queues: under carry_below of a segment
    j.enqueue_fanout([(q, entry(1, body)) for q in ("a", "b", "c")])
    j.commit()
    for s in range(1, 600):  # a stream through another queue kills segments; carry-forward moves the fanout copies
        j.enqueue("fast", entry(s, b"f" * 60))
        if s > 20:
            j.dequeue("fast", s - 20)
        if s % 10 == 0:
            j.commit()
    for s in range(580, 600):
        j.dequeue("fast", s)
    for _ in range(3):
        j.commit()
    on_disk = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert on_disk.count(body) == 1, f"the body is on disk {on_disk.count(body)} times"
    assert j.size_on_disk() < 2 * seg
    j.close()
    _, got = opened(tmp_path, segment_size=seg)
    assert got == {q: [redelivered(entry(1, body))] for q in ("a", "b", "c")}


def test_a_batch_counts_whole_or_not_at_all(tmp_path):
    """A record with a good crc but an impossible body index (a bug, or a
    collision) is refused whole: its first, well-formed enqueue is not applied."""
    j, _ = opened(tmp_path)
    j.enqueue("q", entry(1, b"good"))
    j.commit()
    j.enqueue("q", entry(2, b"two"))
    j.enqueue("q", entry(3, b"three"))
    batch = j.take_staged()
    assert batch.sections[0][1][1][2] == 1  # the second enqueue names body 1: made to name body 7
    batch.enq_bodies[1] = 7
    j.write_and_sync(batch)
    j.committed(batch)
    j.close()
    j, got = opened(tmp_path)
    assert seqs(got) == {"q": [1]}
    assert "malformed batch" in j.dropped[0] and "body 7 of 2" in j.dropped[0]


def _corrupt_at(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_bad_record_is_skipped_what_was_live_before_it_is_withheld_and_it_is_logged(tmp_path, caplog):
    """A byte flipped inside the third of four batches: its record is skipped
    by its length and the fourth batch is restored. The first two batches'
    messages are withheld (the skipped record may have dequeued them) and
    their segment is kept in dropped/ for qflow-salvage. The next recovery,
    after new commits, gives the same and the new ones."""
    j, _ = opened(tmp_path)
    ends = []
    for b in range(4):
        for s in range(b * 10 + 1, b * 10 + 11):
            j.enqueue("q", entry(s, b"p"))
        j.commit()
        ends.append(files_size(tmp_path))
    j.close()
    seg = next(tmp_path.glob("*" + SUFFIX))
    _corrupt_at(seg, ends[1] + 20)  # inside the third batch
    with caplog.at_level(logging.ERROR, logger="qflow.store"):
        j, got = opened(tmp_path)
    assert seqs(got) == {"q": list(range(31, 41))}
    assert j.withheld == {"q": 20}
    assert (f"{seg} at offset {ends[1]} of {ends[3]}: crc32 mismatch over {ends[2] - ends[1] - 8} bytes; "
            f"skipped {ends[2] - ends[1]} bytes") in caplog.text
    assert "20 message(s) of queue 'q' written before a skipped record are not restored" in caplog.text
    assert j.dropped and "crc32" in j.dropped[0]
    snapshot = tmp_path / "dropped" / f"skipped-00000001-at-{ends[1]}"
    assert (snapshot / seg.name).samefile(seg)
    from qflow.store.journal import salvage
    withheld = list(salvage(tmp_path))
    assert [(q, s) for _, q, s, _ in withheld] == [("q", s) for s in range(1, 21)]
    assert {n for n, *_ in withheld} == {snapshot.name}
    j.enqueue("q", entry(41, b"after"))
    j.commit()
    j.close()
    caplog.clear()
    _, got = opened(tmp_path)
    assert seqs(got) == {"q": list(range(31, 42))}
    assert [(q, s) for _, q, s, _ in salvage(tmp_path)] == [("q", s) for s in range(1, 21)]  # the first one decided


def test_a_damaged_length_skips_the_rest_of_its_segment_and_the_later_segments_are_kept(tmp_path):
    seg = 1024
    j, _ = opened(tmp_path, segment_size=seg)
    for s in range(1, 101):
        j.enqueue("q", entry(s, b"v" * 40))
        if s % 5 == 0:
            j.commit()
    j.close()
    names = sorted(p.name for p in tmp_path.glob("*" + SUFFIX))
    assert len(names) >= 4
    second = tmp_path / names[1]
    first_batch = 24 + _length_at(second, 24) + 8
    _corrupt_at(second, first_batch + 3)  # the second batch's length field: nothing to go on in this segment
    j, got = opened(tmp_path, segment_size=seg)
    kept = seqs(got)["q"]
    # The first segment and the second's first batch are withheld, the rest of the second is skipped,
    # and every later segment is restored.
    first_of_third = _first_seq(tmp_path / names[2])
    assert kept == list(range(first_of_third, 101))
    assert "the rest of the segment" in j.dropped[0]
    (snapshot,) = (tmp_path / "dropped").iterdir()
    assert sorted(p.name for p in snapshot.iterdir()) == names
    j.enqueue("q", entry(101, b"new"))
    j.commit()
    j.close()
    _, again = opened(tmp_path, segment_size=seg)
    assert seqs(again)["q"] == list(range(first_of_third, 102))


def _length_at(path: Path, offset: int) -> int:
    return int.from_bytes(path.read_bytes()[offset:offset + 4], "little")


def _first_seq(path: Path) -> int:
    j = Journal(path.parent / "one")
    shutil.rmtree(j.directory, ignore_errors=True)
    j.directory.mkdir()
    shutil.copy(path, j.directory / "00000001.jrn")
    data = bytearray((j.directory / "00000001.jrn").read_bytes())
    data[8 + 7:8 + 15] = (1).to_bytes(8, "little")  # its header names segment 1 now
    import zlib
    data[4:8] = zlib.crc32(bytes(data[8:24])).to_bytes(4, "little")
    (j.directory / "00000001.jrn").write_bytes(bytes(data))
    got = j.recover()
    shutil.rmtree(j.directory)
    return min(seqs(got)["q"])


# -- the model ------------------------------------------------------------------------

QUEUES = ["a", "b", "c"]
op = st.one_of(
    st.tuples(st.just("enq"), st.sampled_from(QUEUES), st.binary(max_size=150)),
    st.tuples(st.just("fanout"), st.lists(st.sampled_from(QUEUES), min_size=2, max_size=3, unique=True),
              st.binary(max_size=150)),
    st.tuples(st.just("accept"), st.sampled_from(QUEUES), st.integers(0, 5)),
    st.tuples(st.just("delete"), st.sampled_from(QUEUES), st.none()),
    st.tuples(st.just("commit"), st.none(), st.none()),
    # The disk quota's compaction (Journal.compact_to_fit), asked for as soon as it would shrink the journal.
    st.tuples(st.just("compact"), st.none(), st.none()),
)


class Model:
    """The broker's view: per queue, seq -> entry; and the committed copy of it."""

    def __init__(self) -> None:
        self.next_seq = dict.fromkeys(QUEUES, 1)
        self.live: dict[str, dict[int, bytes]] = {q: {} for q in QUEUES}
        self.committed = self.snapshot()

    def snapshot(self) -> dict[str, list[bytes]]:
        return {q: [redelivered(m[s]) for s in sorted(m)] for q, m in self.live.items() if m}

    def apply(self, j: Journal, step: tuple) -> None:
        kind, q, arg = step
        if kind == "enq":
            e = entry(self.next_seq[q], arg, q)
            self.next_seq[q] += 1
            self.live[q][seq_of(e)] = e
            j.enqueue(q, e)
        elif kind == "fanout":
            placements = []
            for name in q:
                e = entry(self.next_seq[name], arg, "fan")
                self.next_seq[name] += 1
                self.live[name][seq_of(e)] = e
                placements.append((name, e))
            j.enqueue_fanout(placements)
        elif kind == "accept":  # an accept picks any live message (consumers ack out of order)
            if self.live[q]:
                s = sorted(self.live[q])[arg % len(self.live[q])]
                del self.live[q][s]
                j.dequeue(q, s)
        elif kind == "delete":
            self.live[q].clear()
            self.next_seq[q] = 1  # redeclared later: numbering restarts, as a new Queue's does
            j.delete_queue(q)
        elif kind == "compact":  # changes what is on disk, never what it means
            j.compact_to_fit(j.size_on_disk())


def _run(directory: Path, steps: list[tuple], segment_size: int) -> tuple[Journal, Model]:
    j, _ = opened(directory, segment_size=segment_size)
    m = Model()
    for step in steps:
        if step[0] == "commit":
            j.commit()
            m.committed = m.snapshot()
            assert j.size_on_disk() == files_size(directory)
        else:
            m.apply(j, step)
    return j, m


@settings(max_examples=examples(120), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(op, max_size=60), last=st.lists(op, max_size=15), cut=st.floats(0, 1),
       segment_size=st.sampled_from([256, 1024, 1 << 20]))
def test_model_a_crash_cut_at_any_byte_of_the_last_write_recovers_the_committed_state(
        tmp_path_factory, steps, last, cut, segment_size):
    """Random enqueues, fanouts, accepts, deletions and commits; then one more
    batch whose write is cut at a random byte, as a crash mid-write leaves it.
    Recovery yields the state of the last commit whose record is whole."""
    d = tmp_path_factory.mktemp("j")
    j, m = _run(d, steps, segment_size)
    for step in last:
        if step[0] != "commit":
            m.apply(j, step)
    before = d.parent / (d.name + "-before")
    shutil.copytree(d, before)
    batch = j.take_staged()
    if batch is not None:
        j.write_and_sync(batch)
        j.committed(batch)
        path = d / f"{batch.segment:08d}{SUFFIX}"
        full = path.read_bytes()
        start = (before / path.name).stat().st_size if (before / path.name).exists() else 0
        keep = start + round(cut * (len(full) - start))
        (before / path.name).write_bytes(full[:keep])  # the crash: nothing after the write (no unlink) happened
        expected = m.snapshot() if keep == len(full) else m.committed
    else:
        expected = m.committed
    j.close()
    _, got = opened(before, segment_size=segment_size)
    assert got == expected
    shutil.rmtree(before)


def test_a_crash_anywhere_in_a_compaction_keeps_every_live_message(tmp_path: Path) -> None:
    """The quota's compaction writes the live messages into a new segment and
    only then unlinks the old ones. Cut its write at any point, with no unlink
    done (a crash): recovery has every live message, once."""
    d = tmp_path / "j"
    j, _ = opened(d, segment_size=1 << 20)
    entries = [entry(seq, b"m%03d" % seq + b"." * 200, "q") for seq in range(1, 61)]
    for i in range(0, 60, 10):
        for e in entries[i:i + 10]:
            j.enqueue("q", e)
        j.commit()
    for e in entries[:50]:
        j.dequeue("q", seq_of(e))
    j.commit()
    expected = {"q": [redelivered(e) for e in entries[50:]]}
    saved = tmp_path / "saved"
    shutil.copytree(d, saved)
    assert j.compact_to_fit(j.size_on_disk())
    batch = j.take_staged()
    assert batch is not None and batch.new_segment and batch.unlink
    j.write_and_sync(batch)
    j.committed(batch)
    j.close()
    written = (d / f"{batch.segment:08d}{SUFFIX}").read_bytes()
    assert [p.name for p in d.glob("*" + SUFFIX)] == [f"{batch.segment:08d}{SUFFIX}"]
    assert opened(d, segment_size=1 << 20)[1] == expected
    for keep in sorted({0, 1, 23, 24, 25, len(written) // 2, len(written) - 1, len(written)}):
        crashed = tmp_path / f"crashed-{keep}"
        shutil.copytree(saved, crashed)  # the old segments, not yet unlinked
        (crashed / f"{batch.segment:08d}{SUFFIX}").write_bytes(written[:keep])
        assert opened(crashed, segment_size=1 << 20)[1] == expected, keep


def _replay(batches: list[Batch]) -> dict[str, list[bytes]]:
    """The format's meaning, from the batches as taken: enqueues, dequeues and deletions in staging order."""
    state: dict[str, dict[int, bytes]] = {}
    for b in batches:
        for kind, items in b.sections:
            for item in items:
                q = b.names[item[0]]
                if kind == REC_ENQUEUE:
                    e = b.bodies[item[2]][1]
                    state.setdefault(q, {})[item[1]] = redelivered(e[:2] + item[1].to_bytes(8, "big") + e[10:])
                elif kind == REC_DELETE:
                    state.pop(q, None)
                else:
                    state.get(q, {}).pop(item[1], None)
    return {q: [m[s] for s in sorted(m)] for q, m in state.items() if m}


def _replay_skipping(batches: list[Batch], bad: int) -> dict[str, list[bytes]]:
    """:func:`_replay` with batch ``bad`` skipped: what was live before it is
    withheld unless a later batch enqueues it again, dequeues or deletes it."""
    state: dict[str, dict[int, bytes]] = {}
    suspects: dict[str, set[int]] = {}
    for k, b in enumerate(batches):
        if k == bad:
            for q, m in state.items():
                suspects.setdefault(q, set()).update(m)
            state.clear()
            continue
        for kind, items in b.sections:
            for item in items:
                q = b.names[item[0]]
                if kind == REC_DELETE:
                    state.pop(q, None)
                    suspects.pop(q, None)
                    continue
                suspects.get(q, set()).discard(item[1])
                if kind == REC_ENQUEUE:
                    e = b.bodies[item[2]][1]
                    state.setdefault(q, {})[item[1]] = redelivered(e[:2] + item[1].to_bytes(8, "big") + e[10:])
                else:
                    state.get(q, {}).pop(item[1], None)
    return {q: [m[s] for s in sorted(m)] for q, m in state.items() if m}


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(op, min_size=1, max_size=60), pick=st.floats(0, 1), byte=st.floats(0, 1))
def test_model_a_bad_record_in_the_middle_is_skipped_and_withholds_what_it_may_have_removed(
        tmp_path_factory, steps, pick, byte):
    """A byte flipped inside one committed batch record, past its length field
    (segments big enough that none dies): recovery skips that record and
    applies the others; what was live before it, and not settled by a later
    batch, is withheld. The last record of the journal is a torn write
    instead: recovery keeps exactly the batches before it."""
    d = tmp_path_factory.mktemp("j")
    j, m = opened(d, segment_size=1 << 20)[0], Model()
    batches, spans = [], []
    for step in [*steps, ("commit", None, None)]:
        if step[0] == "compact":  # it makes segments die: this test needs every record kept where it was written
            continue
        if step[0] != "commit":
            m.apply(j, step)
            continue
        batch = j.take_staged()
        if batch is None:
            continue
        path = d / f"{batch.segment:08d}{SUFFIX}"
        start = path.stat().st_size if path.exists() else 24  # a new segment: its header comes first
        j.write_and_sync(batch)
        j.committed(batch)
        batches.append(batch)
        spans.append((path, start, path.stat().st_size))
    j.close()
    assume(batches)
    i = min(int(pick * len(batches)), len(batches) - 1)
    path, start, end = spans[i]
    _corrupt_at(path, start + 4 + min(int(byte * (end - start - 4)), end - start - 5))
    _, got = opened(d, segment_size=1 << 20)
    assert got == (_replay(batches[:i]) if i == len(batches) - 1 else _replay_skipping(batches, i))
    assert _replay(batches) == m.snapshot()  # the replay is the model's state when nothing is torn


_CHILD = """
import sys
from qflow.protocol.entries import ENTRY_HEAD, encode_tail
from qflow.store.journal import Journal
j = Journal(sys.argv[1], segment_size=8192)
j.recover()
tail = encode_tail("", "q", {"durable": True}, b"k" * 100)
seq = 0
while True:
    for _ in range(7):
        seq += 1
        j.enqueue("q", ENTRY_HEAD.pack(0xC2, 0xCF, seq, 0xCF, 100) + tail)
        if seq > 20:
            j.dequeue("q", seq - 20)
    j.commit()
    print(seq, flush=True)  # acknowledged: durable from here on
"""


def test_kill_9_in_the_middle_of_commits_loses_nothing_acknowledged(tmp_path):
    """A child commits in a loop and says each time what is durable; it is
    killed with SIGKILL at an arbitrary point. Everything it acknowledged is
    recovered (the last 20, as it removes older ones), nothing beyond its
    last batch is, and what comes back is a run in order."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    acked = 0
    try:
        for line in child.stdout:
            acked = int(line)
            if acked >= 7 * 300:
                break
    finally:
        child.kill()  # SIGKILL: no cleanup runs in the child
        child.wait()
    # What it acknowledged before dying is still in the pipe.
    acked = max([acked, *(int(line) for line in child.stdout)])
    child.stdout.close()
    assert acked >= 7 * 300, "the child stopped before being killed"
    _, got = opened(tmp_path, segment_size=8192)
    got_seqs = seqs(got)["q"]
    last = got_seqs[-1]
    # The kill may land after a commit it had no time to acknowledge (the page cache outlives the process).
    assert acked <= last <= acked + 7
    assert got_seqs == list(range(last - 19, last + 1))


def test_a_torn_tail_on_a_full_disk_is_cut_without_a_copy(tmp_path, monkeypatch, caplog):
    """Keeping a copy of the cut bytes needs new space, cutting them does not:
    on a full disk (ENOSPC from the copy) the recovery cuts the torn tail,
    says the bytes were not kept, and the journal opens."""
    import errno
    j, _ = opened(tmp_path)
    for s in range(1, 11):
        j.enqueue("q", entry(s, b"p"))
        j.commit()
    j.close()
    seg = next(tmp_path.glob("*" + SUFFIX))
    size = seg.stat().st_size
    with open(seg, "ab") as f:
        f.write(b"\x40\x00\x00\x00torn")  # a record head claiming 64 bytes, and 4 of them

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with caplog.at_level(logging.ERROR, logger="qflow.store"):
        j, got = opened(tmp_path)
    assert seqs(got) == {"q": list(range(1, 11))}
    assert seg.stat().st_size == size
    assert "no space to keep a copy of the 8 bytes cut from" in caplog.text
    assert not any((tmp_path / "dropped").iterdir())
    monkeypatch.undo()
    j.enqueue("q", entry(11, b"after"))
    j.commit()
    j.close()
    assert seqs(opened(tmp_path)[1]) == {"q": list(range(1, 12))}


def test_qflow_salvage_lists_the_withheld_messages(tmp_path):
    import base64
    import json
    import subprocess
    import sys
    journal = tmp_path / "data" / "journal"
    j, _ = opened(journal)
    for b in range(4):
        for s in range(b * 5 + 1, b * 5 + 6):
            j.enqueue("q", entry(s, b"body-%d" % s))
        j.commit()
    j.close()
    seg = next(journal.glob("*" + SUFFIX))
    _corrupt_at(seg, seg.stat().st_size - 10)  # inside the last batch: a torn tail, nothing withheld
    out = subprocess.run([sys.executable, "-m", "qflow.cli.qflow_salvage", "--data-dir", str(tmp_path / "data")],
                         capture_output=True, text=True, check=True).stdout
    assert out == ""
    opened(journal)[0].close()  # cuts the torn tail
    second = 24 + _length_at(seg, 24) + 8
    _corrupt_at(seg, second + 12)  # inside the second batch: the first is withheld
    j, got = opened(journal)
    j.close()
    assert seqs(got) == {"q": list(range(11, 16))}  # the second batch skipped, the fourth cut before
    out = subprocess.run([sys.executable, "-m", "qflow.cli.qflow_salvage", "--data-dir", str(tmp_path / "data")],
                         capture_output=True, text=True, check=True).stdout
    got = [json.loads(line) for line in out.splitlines()]
    assert [(m["queue"], m["sequence"], base64.b64decode(m["body"])) for m in got] == \
        [("q", s, b"body-%d" % s) for s in range(1, 6)]
    assert got[0]["properties"] == {"durable": True} and got[0]["exchange"] == "amq.fanout"
