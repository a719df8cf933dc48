"""The durable store's disk quota (issue 14, qflow.store.quota): overfull and
underfull, as the Qpid Java broker manual states them:

    "Two limits can be configured: overfull limit - the maximum space on disk
    (in bytes) which can be used by store. underfull limit - when the space on
    disk drops below this limit, producers are allowed to resume publishing."

The rule on its own, then through the in-memory harness (the store keeps
holding synced persistent transfers while overfull), the journal's size
falling as messages are accepted, and end to end with a real qflowd, a real
persistent sender, /api/broker, /metrics, qflow-stat and the log lines.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import trio

import qflow
from qflow import protocol as P
from qflow.management import ManagementApi
from qflow.protocol.entries import ENTRY_HEAD, REDELIVERED_NO, encode_tail, redelivered
from qflow.store.journal import SMALLEST_JOURNAL, Journal
from qflow.store.message_store import DISK_QUOTA, MessageStore
from qflow.store.quota import QuotaError, QuotaLimits, StoreQuota
from qflow.testing import Harness
from tests.conftest import bytes_of, table_after
from tests.test_store_config import api, qflowd

DURABLE = {"durable": True}
TIMEOUT = 60


# -- the rule -------------------------------------------------------------------------------------------------
def test_overfull_above_the_limit_until_below_underfull(caplog: pytest.LogCaptureFixture) -> None:
    # The manual: "overfull limit - the maximum space on disk (in bytes) which can be used by store.
    # underfull limit - when the space on disk drops below this limit, producers are allowed to resume".
    quota = StoreQuota(QuotaLimits(overfull=1000, underfull=600))
    caplog.set_level(logging.INFO, "qflow.store")
    assert not quota.update(1000)  # at the limit is not above it
    assert not quota.overfull
    assert quota.update(1001)
    assert quota.overfull and quota.overfull_count == 1
    assert "store overfull: 1001 bytes > 1000, flow control enforced" in caplog.text
    assert not quota.update(800)  # below overfull, not yet below underfull: still overfull
    assert not quota.update(600)  # at underfull is not below it
    assert quota.overfull
    assert quota.update(599)
    assert not quota.overfull
    assert "store overfull condition cleared" in caplog.text
    assert not quota.update(900)  # between the two: not overfull again on the way up
    assert quota.update(5000)
    assert quota.stats() == {"storeSize": 5000, "storeOverfull": True, "storeOverfullCount": 2}


def test_the_manuals_example_quota() -> None:
    # The manual's BDB store configuration: overfull 50000000, underfull 45000000.
    quota = StoreQuota(QuotaLimits(overfull=50_000_000, underfull=45_000_000))
    states = []
    for size in (49_000_000, 50_000_001, 47_000_000, 45_000_000, 44_999_999, 46_000_000):
        quota.update(size)
        states.append(quota.overfull)
    assert states == [False, True, True, True, False, False]
    assert quota.overfull_count == 1


def test_without_underfull_it_equals_overfull() -> None:
    # The manual, for a queue: "Where no flowResumeCapacity is set, the flowResumeCapacity is set to be
    # equal to the capacity"; the issue asks the same of the store.
    quota = StoreQuota(QuotaLimits(overfull=1000))
    assert quota.limits.resume == 1000
    assert quota.update(1001)
    assert not quota.update(1000)
    assert quota.update(999) and not quota.overfull


def test_no_quota_is_never_overfull() -> None:
    quota = StoreQuota(QuotaLimits())
    assert not quota.update(1 << 40)
    assert quota.stats() == {"storeSize": 1 << 40, "storeOverfull": False, "storeOverfullCount": 0}


@pytest.mark.parametrize(("overfull", "underfull", "message"), [
    (-1, None, "--store-overfull-size must be 0 (no quota) or a positive number of bytes, not -1"),
    (1000, -1, "--store-underfull-size must be 0 or a positive number of bytes, not -1"),
    (1000, 1001, "--store-underfull-size 1001 must not be above --store-overfull-size 1000"),
    (0, 10, "--store-underfull-size needs --store-overfull-size"),
])
def test_bad_limits_are_refused_naming_the_option(overfull: int, underfull: int | None, message: str) -> None:
    with pytest.raises(QuotaError) as raised:
        QuotaLimits(overfull, underfull)
    assert message in str(raised.value)


# -- the store holds while overfull (harness) -------------------------------------------------------------------
SEGMENT = 4096


def declare(ssn, name: str, durable: bool = True) -> None:
    ssn.call(P.QUEUE_DECLARE, name, durable, False, False, {}, False)


def open_store(harness: Harness, directory: Path, limits: QuotaLimits) -> MessageStore:
    journal = Journal(directory, segment_size=SEGMENT)
    journal.recover()
    return MessageStore(harness.broker, journal, quota=limits)


def test_synced_persistent_transfers_stay_held_while_overfull_and_are_released_in_order(tmp_path: Path) -> None:
    harness = Harness()
    p = harness.connect().session()
    declare(p, "dq")
    limits = QuotaLimits(overfull=3 * SEGMENT, underfull=SEGMENT)
    store = open_store(harness, tmp_path, limits)
    completed, held, sizes = [], [], []
    while len(held) < 3:  # one commit per transfer: each is checked against the quota after its sync
        cid = p.transfer("dq", b"x" * 500, properties=DURABLE)
        harness.run()
        store.commit_inline()
        harness.run()
        sizes.append(store.journal.size_on_disk())
        (held if store.quota.overfull else completed).append(cid)
    assert sizes[len(completed) - 1] <= limits.overfull < sizes[len(completed)]
    assert not p.incomplete(completed)
    assert p.incomplete(held) == held  # synced, yet held: the store is overfull
    # Best effort, as the manual says: "If several concurrent transactions are started before the limit is
    # reached, which collectively cause the limit to be exceeded, the broker may allow all of them to be
    # committed." The held ones are on disk: a crash now loses none of them.
    again = Journal(tmp_path)
    assert len(again.recover()["dq"]) == len(completed) + len(held)
    again.close()
    assert store.stats() == {"storeSize": sizes[-1], "storeOverfull": True, "storeOverfullCount": 1}
    # A transient message on the same durable queue is not held by the quota: it adds nothing to the store.
    transient = p.transfer("dq", b"t")
    harness.run()
    store.commit_inline()
    harness.run()
    assert p.incomplete([transient]) == []
    # Consume: each accept is journalled, and whole segments die, until the size is below underfull.
    c = harness.connect().session()
    c.subscribe("dq", "d", credit=-1, accept=P.ACCEPT_EXPLICIT)
    total = len(completed) + len(held) + 1
    assert len(c.deliveries) == total  # held transfers' messages are on the queue: consumers get them
    order: list[int] = []
    for delivery in c.deliveries:  # accepted one at a time, oldest first
        c.accept([delivery])
        store.commit_inline()
        harness.run()
        order.append(store.journal.size_on_disk())
        assert p.incomplete(held) == (held if store.quota.overfull else [])  # all at once, once underfull
        if not store.quota.overfull:
            break
    assert order[-1] < limits.resume <= order[-2]
    assert len(order) < total  # released before the queue was empty: underfull, not empty, is the rule
    assert store.stats()["storeOverfullCount"] == 1


def test_the_journal_shrinks_below_underfull_past_a_pinned_message(tmp_path: Path) -> None:
    # "The size must actually fall as messages are consumed": a slow queue's one message stays at the head
    # while another queue's traffic goes through; carry-forward moves it so the old segments die.
    harness = Harness()
    p = harness.connect().session()
    declare(p, "slow")
    declare(p, "busy")
    store = open_store(harness, tmp_path, QuotaLimits(overfull=4 * SEGMENT, underfull=2 * SEGMENT))
    p.transfer("slow", b"pinned" * 50, properties=DURABLE)
    c = harness.connect().session()
    c.subscribe("busy", "d", credit=-1, accept=P.ACCEPT_EXPLICIT)
    biggest = 0
    for _ in range(200):
        p.transfer("busy", b"y" * 700, properties=DURABLE)
        harness.run()
        c.accept(c.deliveries)
        c.deliveries.clear()
        store.commit_inline()
        harness.run()
        biggest = max(biggest, store.journal.size_on_disk())
    # 200 × 700 bytes went through; the journal never held more than the live message and two segments.
    assert biggest <= 3 * SEGMENT
    assert store.journal.size_on_disk() < 2 * SEGMENT
    assert store.stats()["storeOverfullCount"] == 0
    on_disk = sum(f.stat().st_size for f in tmp_path.glob("*.jrn"))
    assert on_disk == store.journal.size_on_disk()
    again = Journal(tmp_path)
    assert [e.endswith(b"pinned" * 50) for e in again.recover()["slow"]] == [True]
    again.close()


@pytest.mark.parametrize("pinned", [False, True], ids=["drained", "a message left on another queue"])
def test_a_quota_below_the_segment_size_clears_once_consumers_drain(tmp_path: Path, pinned: bool) -> None:
    # The Java broker manual: "When consumers consume the messages, causing disk space usage to falls below
    # the underflow limit, the producers are unblocked and continue working as normal." Space comes back a
    # segment at a time, so with a quota below one segment the open segment must be rewritten to its live
    # messages (Journal.compact_to_fit) once that is under underfull, or no segment ever ends.
    harness = Harness()
    p = harness.connect().session()
    declare(p, "dq")
    declare(p, "other")
    journal = Journal(tmp_path, segment_size=1 << 20)  # 1 MiB segments, a 20 kB quota
    journal.recover()
    store = MessageStore(harness.broker, journal, quota=QuotaLimits(overfull=20_000, underfull=8_000))
    if pinned:  # never consumed: the journal is never empty, it can only shrink to what is live
        p.transfer("other", b"pinned" * 100, properties=DURABLE)
    sent = []
    while not store.quota.overfull:
        sent.append(p.transfer("dq", b"x" * 500, properties=DURABLE))
        harness.run()
        store.commit_inline()
        harness.run()
    held = p.incomplete(sent)
    assert held and store.journal.size_on_disk() > 20_000
    c = harness.connect().session()
    c.subscribe("dq", "d", credit=-1, accept=P.ACCEPT_EXPLICIT)
    sizes = []
    for delivery in list(c.deliveries):
        c.accept([delivery])
        store.commit_inline()
        harness.run()
        sizes.append(store.journal.size_on_disk())
        if not store.quota.overfull:
            break
    else:  # the rewrite is asked for by the last commit: its own commit follows
        store.commit_inline()
        harness.run()
    assert not store.quota.overfull, sizes
    assert p.incomplete(held) == []  # the producer goes on
    assert store.journal.size_on_disk() < 8_000
    assert sum(f.stat().st_size for f in tmp_path.glob("*.jrn")) == store.journal.size_on_disk()
    # The rewrite kept exactly what is live: the unconsumed messages, the pinned one included.
    store.journal.close()
    again = Journal(tmp_path)
    recovered = again.recover()
    again.close()
    assert len(recovered.get("dq", [])) == harness.broker.queues["dq"].count
    assert len(recovered.get("other", [])) == (1 if pinned else 0)


def test_compaction_is_asked_for_only_when_it_clears_the_quota(tmp_path: Path) -> None:
    journal = Journal(tmp_path, segment_size=1 << 20)
    journal.recover()
    entries = [ENTRY_HEAD.pack(REDELIVERED_NO, 0xCF, seq, 0xCF, 500) + encode_tail("", "q", {"durable": True}, b"y" * 500)
               for seq in range(1, 41)]
    journal.enqueue_run("q", entries)
    journal.commit()
    size = journal.size_on_disk()
    assert not journal.compact_to_fit(size)  # under the limit already
    assert not journal.compact_to_fit(size // 2)  # everything is live: a rewrite would not get under it
    journal.dequeue_many("q", entries[:35])
    journal.commit()
    assert journal.compact_to_fit(4_000)  # 5 live messages fit under 4 kB
    assert not journal.compact_to_fit(4_000)  # asked for once
    journal.commit()
    assert journal.size_on_disk() < 4_000
    assert [p.name for p in sorted(tmp_path.glob("*.jrn"))] == ["00000002.jrn"]
    journal.close()
    again = Journal(tmp_path)
    assert again.recover()["q"] == [redelivered(e) for e in entries[35:]]
    again.close()


def test_a_quota_that_could_never_clear_is_refused() -> None:
    # The store can never be smaller than an empty journal: an underfull limit at or below that would hold
    # the producers for ever once overfull.
    with pytest.raises(QuotaError) as raised:
        QuotaLimits(1000, SMALLEST_JOURNAL).check_reachable(SMALLEST_JOURNAL)
    assert str(raised.value) == (f"--store-underfull-size {SMALLEST_JOURNAL} can never be cleared: an empty store "
                                 f"takes {SMALLEST_JOURNAL} bytes, so --store-underfull-size (default: "
                                 "--store-overfull-size) must be above it")
    with pytest.raises(QuotaError, match="^--store-overfull-size 40 can never be cleared"):
        QuotaLimits(40).check_reachable(SMALLEST_JOURNAL)
    QuotaLimits(1000, SMALLEST_JOURNAL + 1).check_reachable(SMALLEST_JOURNAL)
    QuotaLimits().check_reachable(SMALLEST_JOURNAL)  # no quota


# -- a real qflowd ------------------------------------------------------------------------------------------------
QUOTA = ("--store-segment-size", "4096", "--store-overfull-size", "20000", "--store-underfull-size", "8000")


def metrics(d) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.mgmt_port}/metrics", timeout=TIMEOUT) as response:
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("qflow_store_")}


def journal_bytes(data_dir: Path) -> int:
    """The journal's files' size now; a segment the store removes while they
    are listed counts 0 (the caller polls until the sizes agree)."""
    total = 0
    for f in (data_dir / "journal").glob("*.jrn"):
        try:
            total += f.stat().st_size
        except FileNotFoundError:
            pass
    return total


async def wait_for(what: str, condition, timeout: float = TIMEOUT, state=None):
    """Poll ``condition`` (run in a thread: it may do blocking HTTP) until it is truthy;
    ``state()`` says what was seen instead, if it times out."""
    with trio.move_on_after(timeout):
        while True:
            got = await trio.to_thread.run_sync(condition)
            if got:
                return got
            await trio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}" + (f": {state()}" if state else ""))


async def wait_held(d, sender, sent) -> dict:
    """Wait until ``sender`` is held by the overfull store: its whole window is
    incomplete on both sides and everything it sent (``sent()``) is on queue
    ``q``. The broker is asked first and the client's counts read after, on the
    client's thread, so a send half done cannot pass. Returns /api/broker."""
    def broker_side() -> tuple[dict, int, int]:
        broker = api(d, "GET", "/api/broker")[1]
        depth = api(d, "GET", "/api/queues/q")[1]["msgDepth"]
        incomplete = [s["incompleteCommands"] for c in api(d, "GET", "/api/connections")[1]
                      for s in c["sessions"] if s["senderCapacity"] == sender.capacity]
        return broker, depth, incomplete[0] if incomplete else -1

    with trio.fail_after(TIMEOUT):
        while True:
            broker, depth, broker_incomplete = await trio.to_thread.run_sync(broker_side)
            if broker["storeOverfull"] and sender.incomplete == broker_incomplete == sender.capacity \
                    and depth == sent():
                return broker
            await trio.sleep(0.05)


async def test_a_persistent_sender_stops_while_the_store_is_overfull_and_resumes_below_underfull(
        tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    d = qflowd(data_dir, *QUOTA)
    capacity, body = 10, b"%06d" + b"." * 400
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn, \
                qflow.open_connection("127.0.0.1", d.port) as consumer_conn:
            ssn = await conn.session()
            await ssn.declare_queue("q", durable=True)
            sender = ssn.sender("q", capacity=capacity, durable=True)
            sent = 0
            stop = trio.Event()

            async def produce() -> None:
                nonlocal sent
                while not stop.is_set():
                    await sender.send(body % sent)
                    sent += 1
                await sender.sync()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)

                broker = await wait_held(d, sender, lambda: sent)
                stop.set()  # the send waiting now is the last one
                stopped_at = sent
                # Held: its whole window is incomplete, and it sends nothing more (its send waits).
                assert broker["storeSize"] > 20000
                assert broker["storeOverfullCount"] == 1
                assert broker["options"]["storeOverfullSize"] == 20000
                assert broker["options"]["storeUnderfullSize"] == 8000
                assert metrics(d)["qflow_store_overfull"] == 1
                assert metrics(d)["qflow_store_overfull_events_total"] == 1
                # A commit taken before the sender was full may still be syncing: it only adds. Once it is
                # done nothing changes, and the counter the API and the metrics show is the files' size.
                await wait_for("the metrics and the journal's files to show the store's size", lambda: (
                    metrics(d)["qflow_store_size_bytes"] == journal_bytes(data_dir)
                    == api(d, "GET", "/api/broker")[1]["storeSize"]))
                stat = await trio.to_thread.run_sync(lambda: subprocess.run(
                    [sys.executable, "-m", "qflow.cli.qflow_stat", "-b", f"127.0.0.1:{d.port}"],
                    capture_output=True, text=True, timeout=TIMEOUT))
                assert stat.returncode == 0, stat.stderr
                columns = table_after(stat.stdout, "Resources")
                assert (columns["storeOverfull"], columns["overfulls"]) == ("Y", "1")
                assert bytes_of(columns["storeSize"]) > 20000 * 0.95
                assert "store quota 20000/8000 bytes" in stat.stdout
                # The session names its holder: in the API, in qflow-stat -c and in the client's held_by.
                (held,) = [s for c in api(d, "GET", "/api/connections")[1] for s in c["sessions"]
                           if s["senderCapacity"] == capacity]
                assert [h.get("holder") for h in held["heldBy"]] == [DISK_QUOTA], held
                assert list(ssn.held_by) == [DISK_QUOTA] and ssn.holders == {DISK_QUOTA}
                assert ssn.held_text() == "the store disk quota"
                stat = await trio.to_thread.run_sync(lambda: subprocess.run(
                    [sys.executable, "-m", "qflow.cli.qflow_stat", "-c", "-b", f"127.0.0.1:{d.port}"],
                    capture_output=True, text=True, timeout=TIMEOUT))
                assert re.search(r" 10 +10 +0 +store disk quota \(\d", stat.stdout), stat.stdout
                (logged,) = re.findall(r"store overfull: (\d+) bytes > 20000, flow control enforced", d.log())
                assert 20000 < int(logged) <= broker["storeSize"]
                assert sent == stopped_at

                # Consume and accept: the journal shrinks, and once it is below underfull the sender goes on.
                cssn = await consumer_conn.session()
                receiver = await cssn.receiver("q", capacity=5)
                got = []
                while len(got) < stopped_at + 1:
                    got.append((await receiver.fetch(timeout=TIMEOUT)).body)
                await receiver.close()  # accepts the last ones fetched
            # produce() returned: its last send went out and sender.sync() saw every transfer complete.
            assert sent == stopped_at + 1
            assert sender.incomplete == 0
            assert got == [body % i for i in range(sent)]  # every message, in order: nothing lost
            assert ssn.held_by == {}  # told it is held no more

            def drained() -> dict | None:
                status, broker = api(d, "GET", "/api/broker")
                if broker["totals"]["msgDepth"] == 0 and broker["storeSize"] < 8000 \
                        and journal_bytes(data_dir) == broker["storeSize"]:
                    return broker
                return None

            broker = await wait_for("the journal to shrink below underfull", drained,
                                    state=lambda: (api(d, "GET", "/api/broker")[1], journal_bytes(data_dir)))
            assert broker["storeOverfull"] is False
            assert broker["storeOverfullCount"] == 1
            assert metrics(d)["qflow_store_overfull"] == 0
    finally:
        d.stop()
    assert d.proc.returncode == 0
    log = d.log()
    assert log.count("flow control enforced") == 1
    assert log.count("store overfull condition cleared") == 1


async def _kill_while_held(d, capacity: int, body: bytes) -> tuple[int, int]:
    """A durable sender of ``body % n`` to durable queue q sends until the overfull store
    holds it, then ``d`` is killed (SIGKILL). Returns (messages sent, transfers complete then)."""
    sent = completed = 0
    try:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            await ssn.declare_queue("q", durable=True)
            sender = ssn.sender("q", capacity=capacity, durable=True)

            async def produce() -> None:
                nonlocal sent
                while True:
                    await sender.send(body % sent)
                    sent += 1

            async with trio.open_nursery() as nursery:
                nursery.start_soon(produce)
                await wait_held(d, sender, lambda: sent)
                completed = sent - sender.incomplete
                d.kill()
                nursery.cancel_scope.cancel()
    except qflow.ConnectionClosed:
        pass
    finally:
        d.kill()
    return sent, completed


async def test_a_restart_on_an_overfull_journal_starts_overfull_and_keeps_the_held_messages(tmp_path: Path) -> None:
    # Held transfers were synced before they were held: a SIGKILL loses none of them.
    data_dir = tmp_path / "data"
    sent, _ = await _kill_while_held(qflowd(data_dir, *QUOTA), 10, b"%06d" + b"." * 400)
    d = qflowd(data_dir, *QUOTA)
    try:
        status, broker = api(d, "GET", "/api/broker")
        assert broker["storeOverfull"] is True and broker["storeOverfullCount"] == 1
        assert broker["totals"]["msgDepth"] == sent  # the held ones too: they were on disk
        (logged,) = re.findall(r"store overfull: (\d+) bytes > 20000, flow control enforced", d.log())
        assert int(logged) > 20000  # at start, from the recovered journal
    finally:
        d.stop()


def test_bad_quota_options_are_refused_at_start_naming_the_option(tmp_path: Path) -> None:
    cases = [
        (("--store-overfull-size", "-1"), "--store-overfull-size must be 0 (no quota) or a positive number"),
        (("--store-overfull-size", "lots"), "argument --store-overfull-size: invalid int value: 'lots'"),
        (("--store-overfull-size", "1000", "--store-underfull-size", "2000"),
         "--store-underfull-size 2000 must not be above --store-overfull-size 1000"),
        (("--store-overfull-size", "1000", "--store-underfull-size", "-5"), "--store-underfull-size must be 0 or"),
        (("--store-underfull-size", "5"), "--store-underfull-size needs --store-overfull-size"),
        (("--store-segment-size", "100"), "--store-segment-size must be 4096..1073741824 bytes, not 100"),
        (("--no-data-dir", "--store-overfull-size", "1000"), "--store-overfull-size needs a data directory"),
        (("--no-data-dir", "--store-segment-size", "8192"), "--store-segment-size needs a data directory"),
    ]
    for args, message in cases:
        done = subprocess.run([sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", "--data-dir",
                               str(tmp_path / "data"), *args] if "--no-data-dir" not in args else
                              [sys.executable, "-m", "qflow.cli.qflowd", "--port", "0", *args],
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 2, (args, done.stderr)
        assert f"qflowd: {message}" in done.stderr, (args, done.stderr)
        assert "ready" not in done.stdout
    assert not (tmp_path / "data").exists()  # refused before anything was created


def test_the_management_api_shows_the_store_and_no_store(tmp_path: Path) -> None:
    harness = Harness()
    p = harness.connect().session()
    declare(p, "dq")
    store = open_store(harness, tmp_path, QuotaLimits(overfull=1000))
    for _ in range(3):
        p.transfer("dq", b"z" * 500, properties=DURABLE)
    harness.run()
    store.commit_inline()
    with_store = ManagementApi(harness.broker, store=store)
    view = json.loads(with_store.handle("GET", b"/api/broker").body)
    assert (view["storeSize"], view["storeOverfull"], view["storeOverfullCount"]) == \
        (store.journal.size_on_disk(), True, 1)
    text = with_store.handle("GET", b"/metrics").body.decode()
    assert f"\nqflow_store_size_bytes {store.journal.size_on_disk()}\n" in text
    assert "\nqflow_store_overfull 1\n" in text
    assert "# TYPE qflow_store_overfull_events_total counter\nqflow_store_overfull_events_total 1\n" in text
    # Without a data directory there is no store: nothing on disk, never overfull.
    view = json.loads(ManagementApi(Harness().broker).handle("GET", b"/api/broker").body)
    assert (view["storeSize"], view["storeOverfull"], view["storeOverfullCount"]) == (0, False, 0)


# -- the operator's scenario, with the tools --------------------------------------------------------------------
OPERATOR_QUOTA = ("--store-overfull-size", "2000000", "--store-underfull-size", "1000000")


def _lines(n: int) -> str:
    return "".join(f"{i:06d}" + "x" * 993 + "\n" for i in range(n))  # 1,000 bytes a message


async def _wait_overfull(d) -> dict:
    return await wait_for("the store to go overfull", lambda: api(d, "GET", "/api/broker")[1]["storeOverfull"]
                          and api(d, "GET", "/api/broker")[1])


@pytest.mark.parametrize("segment", [(), ("--store-segment-size", "65536")],
                         ids=["quota below the segment size", "quota above the segment size"])
async def test_a_held_producer_finishes_once_the_consumer_drains(tmp_path: Path, segment: tuple[str, ...]) -> None:
    # docs/operators.md's options as a new user sets them: a 2 MB quota, 1 MB underfull, 6,000 messages of
    # 1,000 bytes through qflow-send --capacity 20 and qflow-receive. The store goes overfull, the producer
    # is held, the consumer drains: the producer must finish, with every message received in order.
    from tests.test_tools import command, run

    data_dir = tmp_path / "data"
    d = qflowd(data_dir, *OPERATOR_QUOTA, *segment)
    try:
        broker = d.address
        done = run("qflow-config", "-b", broker, "add", "queue", "big", "--durable")
        assert done.returncode == 0, done.stderr
        lines = _lines(6000)
        sender = subprocess.Popen(command("qflow-send") + ["-b", broker, "-a", "big", "--content-stdin",
                                                           "--capacity", "20", "--durable", "yes"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            writer = trio.to_thread.run_sync(sender.communicate, lines, TIMEOUT)
            async with trio.open_nursery() as nursery:
                result: list = []

                async def send() -> None:
                    result.append(await writer)

                nursery.start_soon(send)
                held = await _wait_overfull(d)
                assert held["storeSize"] > 2_000_000
                # The held session says what holds it: the store's disk quota, not a queue.
                (session,) = [s for c in api(d, "GET", "/api/connections")[1] for s in c["sessions"]
                              if s["senderCapacity"] == 20]
                assert [h.get("holder") for h in session["heldBy"]] == [DISK_QUOTA]
                received = await trio.to_thread.run_sync(lambda: run(
                    "qflow-receive", "-b", broker, "-a", "big", "--messages", "6000", "--timeout", "10"))
            out, err = result[0]
        finally:
            if sender.poll() is None:
                sender.kill()
        assert sender.returncode == 0, err
        assert received.returncode == 0, received.stderr
        assert received.stdout == lines  # all 6,000, in order
        # Not overfull once drained (it need not be below underfull: without the quota's pressure the journal
        # keeps its open segment), and the size the API shows is the files' size.
        broker_view = await wait_for("the store not to be overfull and its files to agree", lambda: (
            not (b := api(d, "GET", "/api/broker")[1])["storeOverfull"] and b["totals"]["msgDepth"] == 0
            and journal_bytes(data_dir) == b["storeSize"] and b), state=lambda: api(d, "GET", "/api/broker")[1])
        assert broker_view["storeSize"] <= 2_000_000
        assert broker_view["storeOverfullCount"] >= 1
    finally:
        d.stop()
    assert d.proc.returncode == 0


@pytest.mark.parametrize("segment", [(), ("--store-segment-size", "65536")],
                         ids=["quota below the segment size", "quota above the segment size"])
async def test_a_restart_over_quota_keeps_every_completed_message_and_clears_when_drained(
        tmp_path: Path, segment: tuple[str, ...]) -> None:
    # qflowd is killed (SIGKILL) while overfull with a producer held. The restarted broker is overfull from
    # its recovered journal, has every message whose transfer completed (and the held ones: they were on
    # disk before they were held), and clears once a consumer drains the queue.
    data_dir = tmp_path / "data"
    body = b"%06d" + b"." * 994
    sent, completed = await _kill_while_held(qflowd(data_dir, *OPERATOR_QUOTA, *segment), 20, body)
    assert completed > 0
    d = qflowd(data_dir, *OPERATOR_QUOTA, *segment)
    try:
        broker = api(d, "GET", "/api/broker")[1]
        assert broker["storeOverfull"] is True
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            ssn = await conn.session()
            receiver = await ssn.receiver("q", capacity=50)
            got = [(await receiver.fetch(timeout=TIMEOUT)).body for _ in range(sent)]
            await receiver.close()
        assert got[:completed] == [body % i for i in range(completed)]  # every completed one, in order
        assert got == [body % i for i in range(sent)]  # and the held ones, synced before they were held
        broker = await wait_for("the quota to clear after the drain", lambda: (
            not (b := api(d, "GET", "/api/broker")[1])["storeOverfull"] and b["totals"]["msgDepth"] == 0 and b),
            state=lambda: api(d, "GET", "/api/broker")[1])
        assert broker["storeSize"] < 2_000_000
        assert "store overfull condition cleared" in d.log()
    finally:
        d.stop()
