"""The journal's native sync thread (native/sync_thread.c, qflow.store.sync_thread)
writes exactly the records the Python writer (Journal.write_and_sync) writes,
checksummed with zlib's crc32, says it is done through its eventfd, and
reports a failed write instead of calling it durable. The store task
(qflow.server.store_task) hands it every commit that only appends to the open
segment, and the worker thread the others."""

from __future__ import annotations

import os
import select
import zlib

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from qflow.protocol.entries import ENTRY_HEAD, REDELIVERED_NO, encode_tail, redelivered
from qflow.server.store_task import _write
from qflow.store.journal import Journal, JournalError
from qflow.store.sync_thread import SyncThread, crc32
from tests.conftest import examples


def entry(seq: int, body: bytes, queue: str = "q") -> bytes:
    tail = encode_tail("", queue, {"durable": True}, body)
    return ENTRY_HEAD.pack(REDELIVERED_NO, 0xCF, seq, 0xCF, len(body) + 7) + tail


def opened(path) -> Journal:
    j = Journal(path)
    j.recover()
    return j


def wait_done(sync: SyncThread) -> None:
    """What the store task does with trio: wait until the eventfd is readable, then done()."""
    readable, _, _ = select.select([sync.event_fd], [], [], 30)
    assert readable, "the sync thread did not signal within 30 s"
    sync.done()


@given(st.binary(max_size=3000), st.integers(0, 0xFFFFFFFF))
@settings(max_examples=examples(200), deadline=None)
def test_its_crc32_is_zlibs(data, start):
    """Recovery checks records with zlib.crc32: the thread's must be the same function."""
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data, start) == zlib.crc32(data, start)


def test_a_commit_through_the_thread_writes_the_python_writers_bytes(tmp_path):
    """Two journals stage the same batches; one writes them all in Python, the
    other its first (it opens the segment) in Python and the rest through the
    thread. Their segment files are byte for byte the same, and recover the
    same messages."""
    a, b = opened(tmp_path / "a"), opened(tmp_path / "b")
    sync = SyncThread()
    try:
        for round_ in range(5):
            for j in (a, b):
                j.enqueue_run("q", [entry(round_ * 10 + i, b"x" * (round_ * 37 + i)) for i in range(1, 8)])
                if round_:
                    j.dequeue("q", round_ * 10 - 9)
            a.commit()
            batch = b.take_staged()
            fd = b.fd_for(batch)
            if round_ == 0:
                assert fd == -1, "the first batch opens a segment: only the Python writer may write it"
                b.write_and_sync(batch)
            else:
                assert fd >= 0
                sync.submit(fd, batch)
                wait_done(sync)
            b.committed(batch)
    finally:
        sync.close()
        a.close()
        b.close()
    files_a = sorted(p.name for p in (tmp_path / "a").glob("*.jrn"))
    assert files_a == sorted(p.name for p in (tmp_path / "b").glob("*.jrn"))
    for name in files_a:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    recovered = Journal(tmp_path / "b").recover()
    assert recovered == Journal(tmp_path / "a").recover()
    assert recovered["q"][0] == redelivered(entry(2, b"x" * 2))  # seq 1 was dequeued
    assert len(recovered["q"]) == 5 * 7 - 4


def test_a_failed_write_is_reported_and_closes_the_journal_to_commits(tmp_path):
    """A descriptor the thread cannot write (here: opened read-only) fails the
    commit with the errno, named; the journal then refuses another commit."""
    j = opened(tmp_path)
    j.enqueue("q", entry(1, b"one"))
    j.commit()
    j.enqueue("q", entry(2, b"two"))
    batch = j.take_staged()
    ro = os.open(tmp_path / "00000001.jrn", os.O_RDONLY)
    sync = SyncThread()
    try:
        sync.submit(ro, batch)
        with pytest.raises(OSError, match="writing the journal: Bad file descriptor") as exc:
            wait_done(sync)
        assert exc.value.errno == 9
    finally:
        sync.close()
        os.close(ro)
    j.write_failed("OSError: writing the journal: Bad file descriptor")
    j.committed(batch)
    j.enqueue("q", entry(3, b"three"))
    with pytest.raises(JournalError, match="a write failed"):
        j.take_staged()
    j.close()


def test_it_takes_one_commit_at_a_time_and_done_only_after_the_signal(tmp_path):
    j = opened(tmp_path)
    j.enqueue("q", entry(1, b"one"))
    j.commit()
    sync = SyncThread()
    try:
        with pytest.raises(JournalError, match="before the sync thread said so"):
            sync.done()
        j.enqueue("q", entry(2, b"two"))
        batch = j.take_staged()
        sync.submit(j.fd_for(batch), batch)
        with pytest.raises(JournalError, match="under way"):
            sync.submit(j.fd_for(batch), batch)
        wait_done(sync)
        j.committed(batch)
    finally:
        sync.close()
        j.close()
    assert Journal(tmp_path).recover()["q"] == [redelivered(entry(1, b"one")), redelivered(entry(2, b"two"))]


async def test_the_store_task_writes_appends_in_the_thread_and_new_segments_in_python(tmp_path, monkeypatch):
    """_write, as run_store calls it: a batch that opens a segment goes to
    Journal.write_and_sync (in a worker thread), the next ones to the sync thread."""
    j = opened(tmp_path)
    python_writes = []
    real = j.write_and_sync

    def counted(batch):
        python_writes.append(batch.segment)
        real(batch)

    monkeypatch.setattr(j, "write_and_sync", counted)
    sync = SyncThread()
    try:
        for seq in range(1, 4):
            j.enqueue("q", entry(seq, b"m"))
            batch = j.take_staged()
            await _write(j, batch, sync)
            j.committed(batch)
    finally:
        sync.close()
        j.close()
    assert python_writes == [1], "only the batch that opened segment 1 went through Python"
    assert len(Journal(tmp_path).recover()["q"]) == 3
    await trio.lowlevel.checkpoint()


async def test_the_committer_falls_back_to_a_worker_thread_if_the_native_one_cannot_start(
        tmp_path, monkeypatch, caplog):
    """No native thread (pthread_create failed): qflowd's store still makes
    every persistent transfer durable before it completes, through
    Journal.write_and_sync in a worker thread, and says so once."""
    from qflow import protocol as P
    from qflow.server import store_task
    from qflow.testing import Harness

    def refuse() -> SyncThread:
        raise OSError(11, "cannot start the journal's sync thread: Resource temporarily unavailable")

    monkeypatch.setattr(store_task.sync_thread, "SyncThread", refuse)
    monkeypatch.setattr(store_task.sync_thread, "wanted", lambda: True)
    h = Harness()
    p = h.connect().session()
    p.call(P.QUEUE_DECLARE, "dq", True, False, False, {}, False)
    journal = Journal(tmp_path)
    journal.recover()
    written = []
    real = journal.write_and_sync
    monkeypatch.setattr(journal, "write_and_sync", lambda batch: written.append(batch) or real(batch))
    with trio.fail_after(30):  # a guard against a hang, not a timing assertion
        async with trio.open_nursery() as nursery:
            await nursery.start(store_task.run_store, h.broker, journal)
            ids = [p.transfer("dq", b"m%d" % i, properties={"durable": True}) for i in range(20)]
            h.run()
            while p.incomplete(ids):
                await trio.sleep(0.001)
                h.run()
            nursery.cancel_scope.cancel()
    assert written and sum(len(b.entries) for b in written) == 20
    assert len(Journal(tmp_path).recover()["dq"]) == 20
    assert "commits are written by a worker thread instead" in caplog.text
