"""Persistent messages in qflowd (issue 14), against real qflowd processes that
are SIGKILLed and started again on the same data directory: what survives
(persistent messages on durable queues, nothing else), that a removal is
never undone except as a redelivery of the unsynced tail, and the crash test
the issue asks for: every transfer that completed before a SIGKILL at a
random moment is there after the restart, and nothing else is.
"""

from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

import qflow
from qflow.store.definitions import CONFIG_NAME
from tests.test_store_config import api, qflowd

TIMEOUT = 60


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


async def browse(ssn: qflow.Session, queue: str) -> list[qflow.ReceivedMessage]:
    """Every message on ``queue``, in order, without removing any: as many as
    its depth says (so no wait for an Empty that proves nothing)."""
    depth = (await ssn.query_queue(queue))["msgDepth"]
    if not depth:
        return []
    receiver = await ssn.receiver(queue, browse=True, capacity=1000)
    messages = [await receiver.fetch(timeout=TIMEOUT) for _ in range(depth)]
    await receiver.close()
    return messages


@asynccontextmanager
async def restarted(data_dir: Path) -> AsyncIterator[qflow.Session]:
    """A qflowd on ``data_dir`` and a session on it; the broker is stopped (SIGTERM) after."""
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            yield await conn.session()
    finally:
        d.stop()


def ids(messages: list[qflow.ReceivedMessage]) -> list[int]:
    return [int(m.body) for m in messages]


# -- what survives ----------------------------------------------------------------------------------------------
async def test_persistent_messages_on_durable_queues_survive_a_sigkill_and_nothing_else(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("mixed", durable=True)
            await ssn.declare_queue("pure", durable=True)
            await ssn.declare_queue("scratch")  # not durable
            mixed = ssn.sender("mixed", capacity=10)
            for i in range(40):  # every third one transient, interleaved with the persistent ones
                await mixed.send(str(i).encode(), durable=i % 3 != 0, message_id=f"m{i}")
            pure = ssn.sender("pure", capacity=100, durable=True)
            await pure.send_many([str(i).encode() * (1 + i % 7) for i in range(300)])
            scratch = ssn.sender("scratch", capacity=100, durable=True)
            await scratch.send_many([b"gone"] * 10)
            for sender in (mixed, pure, scratch):
                await sender.sync()  # complete: a persistent one is on disk now
            pure_before = await ssn.query_queue("pure")
            assert pure_before["msgDepth"] == 300
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            got = await browse(ssn, "mixed")
            assert ids(got) == [i for i in range(40) if i % 3 != 0]  # in order, the transient ones gone
            assert [m.message_id for m in got] == [f"m{i}" for i in range(40) if i % 3 != 0]
            assert all(m.redelivered and m.durable for m in got)
            pure_after = await ssn.query_queue("pure")
            assert (pure_after["msgDepth"], pure_after["byteDepth"]) == (300, pure_before["byteDepth"])
            assert [m.body for m in await browse(ssn, "pure")] == [str(i).encode() * (1 + i % 7) for i in range(300)]
            with pytest.raises(qflow.NotFound):
                await ssn.query_queue("scratch")
            # The recovered queue goes on: new messages after the recovered ones, and they are kept too.
            await ssn.declare_queue("late", durable=True)  # declared at run time after a recovery: it carries the store
            sender = ssn.sender("mixed", capacity=10, durable=True)
            await sender.send(b"40")
            late = ssn.sender("late", capacity=10, durable=True)
            await late.send(b"1")
            await sender.sync()
            await late.sync()
    finally:
        d.kill()
    assert f"recovered 326 messages on 2 queues from {data_dir / 'journal'} in " in d.log()
    async with restarted(data_dir) as ssn:
        assert ids(await browse(ssn, "mixed")) == [*(i for i in range(40) if i % 3 != 0), 40]
        assert ids(await browse(ssn, "late")) == [1]


async def test_a_durable_senders_send_may_be_transient_and_sigterm_keeps_what_completed(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("q", durable=True)
            sender = ssn.sender("q", capacity=10, durable=True)
            await sender.send(b"t1", durable=False)
            await sender.send_many([b"t2", b"t3"], durable=False)
            await sender.send(b"p1")
            await sender.send_many([b"p2", b"p3"])
            await sender.sync()
    finally:
        d.stop()
    assert d.proc.returncode == 0
    async with restarted(data_dir) as ssn:
        assert [m.body for m in await browse(ssn, "q")] == [b"p1", b"p2", b"p3"]


async def test_a_durable_senders_plain_sends_are_persistent_and_its_durability_can_change(data_dir: Path) -> None:
    """A durable sender's plain sends take the per-message fast path (the cached
    transfer head carries {"durable": true}); every completed one survives a
    SIGKILL, marked durable. Setting ``sender.durable`` re-encodes the head: what
    follows is transient, and gone after the crash."""
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("q", durable=True)
            sender = ssn.sender("q", capacity=50, durable=True)
            for i in range(300):
                await sender.send(str(i).encode().ljust(8))  # one size: the cached prefix
            sender.durable = False
            assert not sender.durable
            for i in range(300, 320):
                await sender.send(str(i).encode().ljust(8))
            await sender.sync()
            assert (await ssn.query_queue("q"))["msgDepth"] == 320
    finally:
        d.kill()
    async with restarted(data_dir) as ssn:
        back = await browse(ssn, "q")
        assert ids(back) == list(range(300))
        assert all(m.durable and m.redelivered for m in back)


async def test_accepted_messages_stay_gone_and_only_an_unsynced_tail_comes_back(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("work", durable=True)
            sender = ssn.sender("work", capacity=100, durable=True)
            await sender.send_many([str(i).encode() for i in range(100)])
            await sender.sync()
            receiver = await ssn.receiver("work", accept="explicit", capacity=100)
            first = [await receiver.fetch(timeout=TIMEOUT) for _ in range(30)]
            receiver.accept(first)
            # A persistent transfer completes only with a commit that carries every removal staged before it
            # (the accept came first on this session): once it completes, the 30 removals are on disk.
            await sender.send(b"marker")
            await sender.sync()
            more = [await receiver.fetch(timeout=TIMEOUT) for _ in range(30)]
            receiver.accept(more)  # these removals may or may not reach the disk before the kill
            await ssn.sync()
    finally:
        d.kill()
    async with restarted(data_dir) as ssn:
        bodies = [m.body for m in await browse(ssn, "work")]
    left = [int(b) for b in bodies[:-1]]
    assert bodies[-1] == b"marker"
    # Never lost: everything not accepted is there. At most the unsynced tail of the accepted comes back,
    # as a contiguous run just before the never-accepted ones; nothing of the synced first 30.
    assert left == list(range(100 - len(left), 100)), left
    assert len(left) <= 70, left


async def test_a_recovered_queue_above_its_flow_stop_threshold_starts_with_flow_on(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("full", durable=True, arguments={"qpid.max_count": 100,
                                                                      "qpid.flow_stop_count": 50,
                                                                      "qpid.flow_resume_count": 20})
            sender = ssn.sender("full", capacity=100, durable=True)
            await sender.send_many([b"x"] * 49)  # just under the stop threshold: all complete
            await sender.sync()
            assert not (await ssn.query_queue("full"))["flowStopped"]
            # The 50th stops the flow: its completion (and the next ones') is held by flow control, so
            # their being on disk is shown another way: a later persistent transfer on the same session
            # completes only with a commit that carries everything staged before it.
            await sender.send_many([b"x"] * 6)
            with trio.fail_after(TIMEOUT):
                while (await ssn.query_queue("full"))["msgDepth"] < 55:
                    await trio.sleep(0.01)
            assert (await ssn.query_queue("full"))["flowStopped"]
            await ssn.declare_queue("other", durable=True)
            other = ssn.sender("other", capacity=1, durable=True)
            await other.send(b"after")
            await other.sync()
    finally:
        d.kill()
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            q = await ssn.query_queue("full")
            assert q["msgDepth"] == 55 and q["flowStopped"], q
            status, body = api(d, "GET", "/api/queues/full")
            assert status == 200 and body["flowStopped"] == q["flowStopped"]
    finally:
        d.stop()


async def test_qflow_send_durable_yes_end_to_end(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            await (await conn.session()).declare_queue("tool", durable=True)
        for durable, body in (("yes", "kept"), ("no", "lost")):
            done = subprocess.run([sys.executable, "-m", "qflow.cli.qflow_send", "-b", f"127.0.0.1:{d.port}",
                                   "-a", "tool", "--durable", durable, "--messages", "3", "--content-string", body],
                                  capture_output=True, text=True, timeout=TIMEOUT)
            assert done.returncode == 0, done.stderr
    finally:
        d.kill()
    async with restarted(data_dir) as ssn:
        got = await browse(ssn, "tool")
    assert [m.body for m in got] == [b"kept"] * 3
    assert all(m.durable and m.redelivered for m in got)


async def test_messages_of_a_queue_missing_from_the_configuration_are_kept_until_it_is_declared(
        data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("lost", durable=True)
            sender = ssn.sender("lost", capacity=10, durable=True)
            await sender.send_many([b"1", b"2", b"3"])
            await sender.sync()
    finally:
        d.kill()
    (data_dir / CONFIG_NAME).unlink()  # a configuration lost (say, restored from an old backup)
    d = qflowd(data_dir)
    try:
        assert "store: 3 recovered messages for queue 'lost', which is not declared: kept in the journal" in d.log()
        assert "recovered 0 messages on 0 queues" in d.log()
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("lost")  # not durable: the messages stay where they are
            await ssn.delete_queue("lost")
            await ssn.declare_queue("lost", durable=True)
            assert (await ssn.query_queue("lost"))["msgDepth"] == 3
            # New messages are numbered after the recovered ones: none takes a kept one's place.
            sender = ssn.sender("lost", capacity=10, durable=True)
            await sender.send(b"4")
            await sender.sync()
            got = await browse(ssn, "lost")
            assert ids(got) == [1, 2, 3, 4] and [m.redelivered for m in got] == [True, True, True, False]
    finally:
        d.kill()
    async with restarted(data_dir) as ssn:
        assert ids(await browse(ssn, "lost")) == [1, 2, 3, 4]


# -- a journal that cannot be written ----------------------------------------------------------------------
async def test_a_failed_journal_write_stops_qflowd_and_completes_nothing_undurably(data_dir: Path) -> None:
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("q", durable=True)
            await ssn.declare_queue("t")
            kept = ssn.sender("q", capacity=10, durable=True)
            await kept.send(b"before")
            await kept.sync()
            # A limit on the size of any file qflowd writes, far above its log and config.log but below
            # a record of the messages below: the journal's write fails (EFBIG, or short).
            resource.prlimit(d.proc.pid, resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
            sender = ssn.sender("q", capacity=10, durable=True)
            with pytest.raises(qflow.ConnectionClosed):
                await sender.send_many([b"x" * (100 << 10)] * 3)
                await sender.sync()
            assert sender.incomplete == 3  # never completed: they were never on disk
        assert d.proc.wait(timeout=TIMEOUT) == 1
    finally:
        d.kill()
    log = d.log()
    assert "store: writing the message journal in " in log and "stopping: persistent messages" in log, log
    assert "qflowd: the message journal in " in log, log
    async with restarted(data_dir) as ssn:
        assert [m.body for m in await browse(ssn, "q")] == [b"before"]


# -- the crash test ----------------------------------------------------------------------------------------------
CRASH_SEED = int(os.environ.get("QFLOW_CRASH_SEED", "20261123"))
CRASH_CYCLES = 6


class Stream:
    """One producer's persistent stream, numbered across the cycles; what the
    client knows completed and what it accepted."""

    def __init__(self) -> None:
        self.next = 0  # the number of the next message sent
        self.completed: list[list[int]] = []  # per cycle: the numbers whose transfers completed
        self.accepted: set[int] = set()


async def produce(port: int, stream: Stream) -> None:
    """Send until the broker dies, then note which transfers completed, by command id:
    completions may come out of order (a message accepted before its commit completes at
    once), so a count of them would not say which."""
    sent: list[tuple[int, int]] = []  # (number, command id)
    sender = commands = None
    try:
        async with qflow.open_connection("127.0.0.1", port) as conn:
            ssn = await conn.session()
            commands = ssn.commands
            sender = ssn.sender("stream", capacity=100, durable=True)
            while True:
                await sender.send(str(stream.next).encode())
                sent.append((stream.next, commands.next_id - 1))  # the session's only commands are these
                stream.next += 1
    except (qflow.QflowError, OSError):
        pass  # the SIGKILL
    finally:
        # The connection is gone: no completion can arrive any more, so this is final.
        stream.completed.append([n for n, cid in sent if commands is not None
                                 and commands.owner_of(cid) is not sender])


async def consume(port: int, stream: Stream) -> None:
    """Accept every fourth message (and leave the others acquired), so that removals
    race with the kill too."""
    try:
        async with qflow.open_connection("127.0.0.1", port) as conn:
            receiver = await (await conn.session()).receiver("stream", accept="explicit", capacity=200)
            while True:
                m = await receiver.fetch()
                n = int(m.body)
                if n % 4 == 0:
                    stream.accepted.add(n)  # before the accept is sent: it may be applied and synced at once
                    m.accept()
    except (qflow.QflowError, OSError):
        pass


async def test_every_completed_transfer_survives_a_sigkill_at_a_random_moment(data_dir: Path) -> None:
    rng = random.Random(CRASH_SEED)
    where = f"(QFLOW_CRASH_SEED={CRASH_SEED})"
    stream = Stream()
    d = qflowd(data_dir)
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            await (await conn.session()).declare_queue("stream", durable=True)
        for cycle in range(CRASH_CYCLES):
            delay = rng.uniform(0.05, 0.6)
            with trio.fail_after(TIMEOUT):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(produce, d.port, stream)
                    nursery.start_soon(consume, d.port, stream)
                    await trio.sleep(delay)
                    d.kill()
            d = qflowd(data_dir)
            async with qflow.open_connection("127.0.0.1", d.port) as conn:
                present = ids(await browse(await conn.session(), "stream"))
            at = f"{where} cycle {cycle}, killed after {delay:.3f}s"
            assert present == sorted(set(present)), f"out of order or duplicated {at}"
            assert not present or present[-1] < stream.next, f"a message that was never sent {at}"
            have = set(present)
            lost = [n for done in stream.completed for n in done if n not in have and n not in stream.accepted]
            assert not lost, f"{len(lost)} completed messages lost, the first {lost[:10]} {at}"
    finally:
        d.stop()
    completed = sum(len(done) for done in stream.completed)
    # Not vacuous: transfers completed, and the kills came mid-stream (some sent never completed).
    assert completed > 0 and stream.next > completed, f"{completed} completed of {stream.next} {where}"


def test_no_data_dir_has_no_journal(tmp_path: Path) -> None:
    from qflow.testing import start
    d = start("--no-data-dir", log=str(tmp_path / "qflowd.log"))
    d.stop()
    assert "recovered" not in d.log() and "nothing survives a restart" in d.log()
