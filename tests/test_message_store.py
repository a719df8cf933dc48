"""The durable store as the holder of transfers' completion (qflow.store.message_store),
through the in-memory harness: a persistent transfer to a durable queue completes
only after the commit that makes it durable; a transient one, or one to a
transient queue, does not wait for the disk; removals are journalled; and the
journal recovers what the broker held. Also the trio committer task
(qflow.server.store_task) against a real broker, syncs in a worker thread."""

from __future__ import annotations

import pytest
import trio

from qflow import protocol as P
from qflow.protocol.entries import ENTRY_HEAD, encode_tail, message_size
from qflow.server.store_task import run_store
from qflow.store.journal import Journal
from qflow.store.message_store import MessageStore, is_persistent
from qflow.testing import Harness

DURABLE = {"durable": True}


@pytest.fixture(params=[True, False], ids=["runs", "frames"])
def harness(request) -> Harness:
    return Harness(transfer_runs=request.param)


def declare(ssn, name: str, durable: bool = True) -> None:
    ssn.call(P.QUEUE_DECLARE, name, durable, False, False, {}, False)


def recovered(directory) -> dict[str, list[int]]:
    j = Journal(directory)
    got = j.recover()
    j.close()
    return {q: [int.from_bytes(e[2:10], "big") for e in es] for q, es in got.items()}


def open_store(harness: Harness, directory) -> MessageStore:
    journal = Journal(directory, segment_size=1 << 16)
    journal.recover()
    return MessageStore(harness.broker, journal)


def test_is_persistent_reads_the_durable_property():
    def entry(props, body=b"b", exchange="", routing_key="q"):
        tail = encode_tail(exchange, routing_key, props, body)
        return ENTRY_HEAD.pack(0xC2, 0xCF, 1, 0xCF, message_size(len(tail), len(body))) + tail

    assert is_persistent(entry({"durable": True}))
    assert not is_persistent(entry({"durable": False}))
    assert not is_persistent(entry(None, b"durable"))  # the word in the body is not the property
    assert not is_persistent(entry({"headers": {"x": "durable"}}))
    assert not is_persistent(entry(None))
    assert is_persistent(entry({"durable": True, "x": "y" * 300}, b"durable" * 10_000))  # str16 key, bin32 body
    assert is_persistent(entry({"durable": True}, b"d" * 300, "e" * 40, "k" * 300))  # a str16 routing key


def test_a_persistent_transfer_completes_only_after_its_commit(harness, tmp_path):
    p = harness.connect().session()
    declare(p, "dq")
    store = open_store(harness, tmp_path)
    ids = [p.transfer("dq", b"m%d" % i, properties=DURABLE) for i in range(3)]
    harness.run()
    assert p.incomplete(ids) == ids
    assert recovered(tmp_path) == {}  # nothing on disk yet
    commit = store.prepare()
    harness.broker.flush()
    harness.run()
    assert p.incomplete(ids) == ids  # staged, not synced: still held
    store.journal.write_and_sync(commit.batch)
    assert p.incomplete(ids) == ids
    store.finish(commit)
    harness.broker.flush()
    harness.run()
    assert not p.incomplete(ids)
    assert recovered(tmp_path) == {"dq": [1, 2, 3]}


def test_transient_messages_and_transient_queues_do_not_wait_for_the_disk(harness, tmp_path):
    p = harness.connect().session()
    declare(p, "dq")
    declare(p, "tq", durable=False)
    store = open_store(harness, tmp_path)
    transient = p.transfer("dq", b"t")
    to_transient_queue = p.transfer("tq", b"p", properties=DURABLE)
    harness.run()
    assert p.incomplete([to_transient_queue]) == []  # never held: the queue carries no store
    assert p.incomplete([transient]) == [transient]  # held until the store looks at it, once
    commit = store.prepare()
    assert commit is None  # nothing to write: the transient hold was simply let go
    harness.broker.flush()
    harness.run()
    assert p.incomplete([transient]) == []
    assert recovered(tmp_path) == {}


def test_accepted_messages_are_removed_from_the_journal(harness, tmp_path):
    p = harness.connect().session()
    declare(p, "dq")
    store = open_store(harness, tmp_path)
    for i in range(5):
        p.transfer("dq", b"m%d" % i, properties=DURABLE)
    harness.run()
    store.commit_inline()
    c = harness.connect().session()
    c.subscribe("dq", "d", credit=2, accept=P.ACCEPT_EXPLICIT)
    harness.run()
    assert len(c.deliveries) == 2
    c.accept(c.deliveries)
    store.commit_inline()
    assert recovered(tmp_path) == {"dq": [3, 4, 5]}
    # A purge, and a message staged and removed before any commit, leave nothing behind.
    p.transfer("dq", b"late", properties=DURABLE)
    harness.run()
    p.call(P.QUEUE_PURGE, "dq")
    store.commit_inline()
    assert recovered(tmp_path) == {}


def test_messages_accepted_before_their_commit_are_never_written_and_complete_at_once(harness, tmp_path):
    """A persistent message consumed and accepted before the store staged it
    has nothing left to make durable: its transfer completes at the next
    commit without a write, and no record of it reaches the journal; the
    others of its run are written as usual."""
    p = harness.connect().session()
    declare(p, "dq")
    store = open_store(harness, tmp_path)
    ids = [p.transfer("dq", b"m%d" % i, properties=DURABLE) for i in range(6)]
    harness.run()
    c = harness.connect().session()
    c.subscribe("dq", "d", credit=4, accept=P.ACCEPT_EXPLICIT)
    harness.run()
    c.accept(c.deliveries[:2] + c.deliveries[3:4])  # 1, 2 and 4, before anything was staged
    harness.run()
    assert p.incomplete(ids) == ids
    commit = store.prepare()
    harness.broker.flush()
    harness.run()
    assert p.incomplete(ids) == [ids[2], ids[4], ids[5]]  # the accepted ones complete with no write
    assert commit.batch.entries and [int.from_bytes(e[2:10], "big") for e in commit.batch.entries] == [3, 5, 6]
    assert not commit.batch.deq_seqs  # nothing to remove: they were never written
    store.journal.write_and_sync(commit.batch)
    store.finish(commit)
    harness.broker.flush()
    harness.run()
    assert not p.incomplete(ids)
    assert recovered(tmp_path) == {"dq": [3, 5, 6]}


def test_fanout_to_durable_queues_is_one_hold_and_one_body(harness, tmp_path):
    p = harness.connect().session()
    for name in ("a", "b", "c"):
        declare(p, name)
        p.call(P.EXCHANGE_BIND, "amq.fanout", name, name)
    store = open_store(harness, tmp_path)
    cid = p.transfer("", b"x" * 10_000, "amq.fanout", properties=DURABLE)
    harness.run()
    assert p.incomplete([cid]) == [cid]
    store.commit_inline()
    harness.run()
    assert p.is_complete(cid)
    assert recovered(tmp_path) == {"a": [1], "b": [1], "c": [1]}
    assert store.journal.size_on_disk() < 11_000


def test_a_deleted_durable_queue_stays_empty(harness, tmp_path):
    p = harness.connect().session()
    declare(p, "dq")
    store = open_store(harness, tmp_path)
    p.transfer("dq", b"m", properties=DURABLE)
    harness.run()
    store.commit_inline()
    p.call(P.QUEUE_DELETE, "dq", False, False)
    store.commit_inline()
    assert recovered(tmp_path) == {}


def test_a_queue_deleted_and_declared_again_before_a_commit_keeps_its_new_persistent_messages(harness, tmp_path):
    """The old queue's removals not yet committed must not keep the new queue's
    messages, numbered from 1 again, out of the journal."""
    p = harness.connect().session()
    declare(p, "dq")
    store = open_store(harness, tmp_path)
    for i in range(3):
        p.transfer("dq", b"t%d" % i)  # transient: sequence numbers 1-3, removed by the purge, none journalled
    harness.run()
    p.call(P.QUEUE_PURGE, "dq")
    p.call(P.QUEUE_DELETE, "dq", False, False)
    declare(p, "dq")
    ids = [p.transfer("dq", b"p%d" % i, properties=DURABLE) for i in range(2)]  # persistent: 1 and 2
    harness.run()
    store.commit_inline()
    harness.run()
    assert not p.incomplete(ids)
    assert recovered(tmp_path) == {"dq": [1, 2]}


def test_the_persistent_answer_kept_for_a_run_fits_only_the_same_fields(tmp_path):
    """MessageStore keeps the bytes of the last persistent message's exchange,
    routing key and properties, so a durable sender's run costs one comparison
    per message; a message that differs anywhere in them is asked afresh."""
    def entry(props, routing_key="q", body=b"b"):
        tail = encode_tail("", routing_key, props, body)
        return ENTRY_HEAD.pack(0xC2, 0xCF, 1, 0xCF, message_size(len(tail), len(body))) + tail

    store = open_store(Harness(), tmp_path)
    assert store._is_persistent(entry(DURABLE))
    assert store._is_persistent(entry(DURABLE, body=b"d" * 70_000))  # the same head, a bin32 body
    assert not store._is_persistent(entry(None))
    assert not store._is_persistent(entry({"durable": False}))
    assert not store._is_persistent(entry(None, "q\x81"))  # the kept bytes must not match a longer key's start
    assert store._is_persistent(entry({"durable": True, "message_id": "x"}))
    assert store._is_persistent(entry(DURABLE, "other"))
    assert not store._is_persistent(entry(None, "other"))
    assert not store._is_persistent(entry({"headers": {"durable": True}}, "other"))


def test_a_ring_queue_overwriting_in_the_same_batch_stores_only_what_it_keeps(harness, tmp_path):
    """Messages overwritten before their hold even reaches the store (the same
    input batch) must not be written at all, or they would come back."""
    p = harness.connect().session()
    p.call(P.QUEUE_DECLARE, "ring", True, False, False, {"qpid.max_count": 2, "qpid.policy_type": "ring"}, False)
    store = open_store(harness, tmp_path)
    ids = [p.transfer("ring", b"m%d" % i, properties=DURABLE) for i in range(6)]
    harness.run()
    store.commit_inline()
    harness.run()
    assert not p.incomplete(ids)
    assert recovered(tmp_path) == {"ring": [5, 6]}
    for i in range(3):
        p.transfer("ring", b"n%d" % i, properties=DURABLE)
        harness.run()
    store.commit_inline()
    assert recovered(tmp_path) == {"ring": [8, 9]}


def test_recovery_puts_messages_back_in_order_with_depth_and_flow_recomputed(harness, tmp_path):
    p = harness.connect().session()
    declare(p, "dq")
    store = open_store(harness, tmp_path)
    for i in range(5):
        p.transfer("dq", b"m%d" % i, properties=DURABLE)
    p.transfer("dq", b"transient")
    harness.run()
    store.commit_inline()
    store.journal.close()

    # A restart: a new broker, the durable queue declared (now with a stop threshold of 3), then the store.
    h = Harness(transfer_runs=harness.broker.runs is not None)
    p = h.connect().session()
    p.call(P.QUEUE_DECLARE, "dq", True, False, False,
           {"qpid.flow_stop_count": 3, "qpid.flow_resume_count": 2}, False)
    journal = Journal(tmp_path)
    store = MessageStore(h.broker, journal)
    store.restore(journal.recover())
    q = h.broker.queues["dq"]
    # Each message's size: exchange "" 1 + routing key "dq" 3 + {"durable": true} 10 + body 2 = 16 bytes.
    assert (q.count, q.nbytes) == (5, 80)
    assert h.broker.completion.stats(q)[:3] == (5, 80, True)  # above its stop threshold: flow on
    cid = p.transfer("dq", b"new", properties=DURABLE)
    h.run()
    store.commit_inline()
    h.run()
    assert p.incomplete([cid]) == [cid]  # held by flow control now, not by the store
    c = h.connect().session()
    c.subscribe("dq", "d", accept=P.ACCEPT_EXPLICIT)
    h.run()
    assert [(d.sequence, d.redelivered, d.body) for d in c.deliveries] == [
        *((i + 1, True, b"m%d" % i) for i in range(5)), (6, False, b"new")]
    c.accept(c.deliveries[:5])
    store.commit_inline()
    h.run()
    assert p.is_complete(cid)
    assert recovered(tmp_path) == {"dq": [6]}


async def test_the_committer_task_syncs_off_the_loop_and_completes_transfers(tmp_path):
    """The real trio task: persistent transfers complete once the worker
    thread's sync returned, and the journal has them; transient ones complete
    without a commit."""
    h = Harness()
    p = h.connect().session()
    declare(p, "dq")
    journal = Journal(tmp_path)
    journal.recover()
    with trio.fail_after(30):  # a guard against a hang, not a timing assertion
        async with trio.open_nursery() as nursery:
            await nursery.start(run_store, h.broker, journal)
            persistent = [p.transfer("dq", b"m%d" % i, properties=DURABLE) for i in range(50)]
            transient = p.transfer("dq", b"t")
            h.run()
            assert p.incomplete(persistent) == persistent  # the task has not run yet
            while p.incomplete([*persistent, transient]):
                await trio.sleep(0.001)
                h.run()
            assert recovered(tmp_path) == {"dq": list(range(1, 51))}
            nursery.cancel_scope.cancel()


async def test_a_failed_sync_stops_the_task_and_completes_nothing(tmp_path):
    """A write or sync that fails leaves the transfers held (completing them
    would claim durability) and ends the task with the error, for the daemon to stop."""
    h = Harness()
    p = h.connect().session()
    declare(p, "dq")
    journal = Journal(tmp_path)
    journal.recover()

    def disk_full(batch):
        raise OSError(28, "No space left on device")

    journal.write_and_sync = disk_full
    ids = [p.transfer("dq", b"m", properties=DURABLE) for _ in range(3)]
    failed: tuple = ()
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(run_store, h.broker, journal)
                h.run()
                await trio.sleep_forever()
    except* OSError as group:
        failed = group.exceptions
    assert [str(e) for e in failed] == ["[Errno 28] No space left on device"]
    h.run()
    assert p.incomplete(ids) == ids
