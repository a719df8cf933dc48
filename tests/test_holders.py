"""Outside holders of a transfer's completion (issue 20: what the durable store
plugs into), run deterministically through the in-memory harness, with the
broker taking transfers in runs (C) and frame by frame. A transfer completes
when its routing, each stopped queue and each outside holder have let go."""

from __future__ import annotations

import io

import msgpack
import pytest

from qflow import protocol as P
from qflow.broker import Broker
from qflow.broker.completion import Holder
from qflow.broker.ops import OP_END, OP_ENQUEUE, OP_HOLD, OP_TRANSFER, OP_TRANSFER1
from qflow.protocol.entries import entry_tail, seq_of
from qflow.protocol.ranges import RangeSet
from qflow.testing import Harness, MemorySession

STOP_AT_2 = {"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1}


@pytest.fixture(params=[True, False], ids=["runs", "frames"])
def harness(request) -> Harness:
    h = Harness(transfer_runs=request.param)
    if request.param:  # make sure the run path is the one taken for queues with outside holders
        broker, taken = h.broker, []
        fanout_run = broker._fanout_run
        broker._fanout_run = lambda *args: taken.append(fanout_run(*args)) or taken[-1]
        h.runs_taken = taken
    return h


def send(h: Harness, ssn: MemorySession, queue: str, n: int, body: bytes = b"x", exchange: str = "") -> list[int]:
    ids = [ssn.transfer(queue, body, exchange) for _ in range(n)]
    h.run()
    return ids


def drain(h: Harness, ssn: MemorySession, queue: str, n: int) -> None:
    destination = f"drain-{len(ssn.deliveries)}-{n}"
    ssn.subscribe(queue, destination, credit=n)
    ssn.call(P.CANCEL, destination)


def release(h: Harness, holder: Holder, tokens: list[int]) -> None:
    """What the store will do once its write is synced: release, then flush (no input batch is under way)."""
    holder.release(tokens)
    h.broker.flush()
    h.run()


def tokens(held: list) -> list[int]:
    return [token for token, _ in held]


def test_a_transfer_is_not_complete_until_its_holder_releases(harness: Harness):
    p = harness.connect().session()
    p.declare_queue("q")
    woken = []
    store = harness.broker.add_holder("store", wake=lambda: woken.append(1))
    harness.broker.queues["q"].add_holder(store)
    ids = send(harness, p, "q", 3, b"body")
    assert p.incomplete(ids) == ids
    assert woken and harness.broker.acct.stats(store.slot) == (0, 0, False, 0, 3)
    held = store.take()
    assert store.take() == []
    q = harness.broker.queues["q"]
    # One hold per transfer, with the message it holds: the queue and the entry as stored.
    assert [(queue, seq_of(entry), entry_tail(entry)) for _, messages in held for queue, entry in messages] == [
        (q, seq, ("", "q", None, b"body")) for seq in (1, 2, 3)]
    assert q.count == 3 and not p.held_by  # held by the store, not by flow control: no flow notice
    release(harness, store, tokens(held)[:2])
    assert p.incomplete(ids) == ids[2:]
    release(harness, store, tokens(held))  # the first two again: ignored
    assert not p.incomplete(ids)
    assert harness.broker.acct.stats(store.slot)[4] == 0
    if harness.broker.runs is not None:
        assert harness.runs_taken and all(harness.runs_taken)


def test_a_run_to_one_held_queue_reaches_its_holder_as_one_uniform_run(harness: Harness):
    """The store's usual input (a run of transfers to one durable queue) is
    handed over as (queue, tokens, entries), no tuple per transfer; take()
    then has nothing more, and the tokens release as any others do."""
    p = harness.connect().session()
    p.declare_queue("q")
    store = harness.broker.add_holder("store")
    q = harness.broker.queues["q"]
    q.add_holder(store)
    ids = send(harness, p, "q", 4, b"body")
    runs = store.take_runs()
    if harness.broker.runs is None:  # frame by frame: the holds come as pairs, as before
        assert runs == []
        held = store.take()
        tokens_ = tokens(held)
        assert [seq_of(messages[0][1]) for _, messages in held] == [1, 2, 3, 4]
    else:
        assert len(runs) == 1 and runs[0][0] is q
        _, tokens_, entries, seqs = runs[0]
        assert [seq_of(e) for e in entries] == list(seqs) == [1, 2, 3, 4]
        assert [entry_tail(e) for e in entries] == [("", "q", None, b"body")] * 4
        assert store.take() == []
    assert len(set(tokens_)) == 4
    release(harness, store, tokens_[:3])
    assert p.incomplete(ids) == ids[3:]
    release(harness, store, tokens_)
    assert not p.incomplete(ids)


def test_runs_to_two_held_queues_in_one_batch_arrive_as_one_run_each(harness: Harness):
    """Several runs of transfers in one applied log, to two durable queues:
    one uniform run each, in order, each naming its queue."""
    p = harness.connect().session()
    for name in ("a", "b"):
        p.declare_queue(name)
    store = harness.broker.add_holder("store")
    for name in ("a", "b"):
        harness.broker.queues[name].add_holder(store)
    ids = [p.transfer(name, body.encode(), "") for name, body in (("a", "a1"), ("a", "a2"), ("b", "b1"), ("a", "a3"))]
    harness.run()
    if harness.broker.runs is None:
        held = store.take()
    else:
        runs = store.take_runs()
        assert [(q.name, [entry_tail(e)[3] for e in entries], list(seqs)) for q, _, entries, seqs in runs] == [
            ("a", [b"a1", b"a2"], [1, 2]), ("b", [b"b1"], [1]), ("a", [b"a3"], [3])]
        assert store.take() == []
        held = [(t, ((q, e),)) for q, tokens_, entries, _ in runs for t, e in zip(tokens_, entries, strict=True)]
    assert [(messages[0][0].name, entry_tail(messages[0][1])[3]) for _, messages in held] == [
        ("a", b"a1"), ("a", b"a2"), ("b", b"b1"), ("a", b"a3")]
    release(harness, store, tokens(held))
    assert not p.incomplete(ids)


def test_runs_mixed_with_a_fanout_in_one_batch_arrive_as_pairs_each_with_its_queue(harness: Harness):
    """A log whose holds are not all of runs (a fanout's transfer holds two
    queues' messages at once): every hold comes as a pair, the runs' ones
    naming their own queue."""
    p = harness.connect().session()
    store = harness.broker.add_holder("store")
    for name in ("a", "b"):
        p.declare_queue(name)
        p.call(P.EXCHANGE_BIND, "amq.fanout", name, "")
        harness.broker.queues[name].add_holder(store)
    ids = [p.transfer("a", b"a1", ""), p.transfer("", b"fan", "amq.fanout"), p.transfer("b", b"b1", "")]
    harness.run()
    assert store.take_runs() == []
    held = store.take()
    assert [[(q.name, entry_tail(e)[3]) for q, e in messages] for _, messages in held] == [
        [("a", b"a1")], [("a", b"fan"), ("b", b"fan")], [("b", b"b1")]]
    release(harness, store, tokens(held))
    assert not p.incomplete(ids)


def test_take_gives_the_runs_not_taken_as_pairs_first(harness: Harness):
    """A holder that never asks for runs (the memory alarm, a test) sees every hold through take()."""
    p = harness.connect().session()
    p.declare_queue("q")
    store = harness.broker.add_holder("store")
    q = harness.broker.queues["q"]
    q.add_holder(store)
    send(harness, p, "q", 2)
    send(harness, p, "q", 1)
    held = store.take()
    assert [(queue, seq_of(entry)) for _, messages in held for queue, entry in messages] == [(q, 1), (q, 2), (q, 3)]
    assert store.take_runs() == [] and store.take() == []


def test_a_tracking_holder_named_later_names_the_sessions_it_holds_then(harness: Harness):
    """The store's quota: holds given while it was not named, less those it let
    go (even if the release is still in the unapplied log), name their
    sessions when it is named; the last one let go tells the session so."""
    p, other = harness.connect().session(), harness.connect().session()
    p.declare_queue("q")
    store = harness.broker.add_holder("store", tracks=True)
    harness.broker.carry(store, lambda q: q.name == "q")
    ids = send(harness, p, "q", 3)
    done_ids = send(harness, other, "q", 1)
    held = [t for run in store.take_runs() for t in run[1]] + tokens(store.take())
    assert len(held) == 4 and not p.held_by and not other.held_by
    store.release(held[3:])  # other's transfer: let go, the release not applied yet
    harness.broker.name_holder(store, "store disk quota")
    harness.broker.flush()
    harness.run()
    assert p.held_by == {"store disk quota"} and not other.held_by
    assert not other.incomplete(done_ids)
    release(harness, store, held[:2])
    assert p.held_by == {"store disk quota"}  # one of its transfers is still held
    release(harness, store, held[2:3])
    assert not p.held_by and not p.incomplete(ids)


@pytest.mark.parametrize("holder_first", [True, False], ids=["holder-first", "queue-first"])
def test_a_transfer_held_by_a_stopped_queue_and_a_holder_waits_for_both(harness: Harness, holder_first: bool):
    p = harness.connect().session()
    p.declare_queue("q", STOP_AT_2)
    store = harness.broker.add_holder("store")
    harness.broker.queues["q"].add_holder(store)
    first = send(harness, p, "q", 2)
    release(harness, store, tokens(store.take()))
    assert not p.incomplete(first)
    held = send(harness, p, "q", 1)  # the third: flow stops, and the store holds it too
    assert p.held_by == {"q"} and p.incomplete(held) == held
    c = harness.connect().session()
    if holder_first:
        release(harness, store, tokens(store.take()))
        assert p.incomplete(held) == held  # the queue still holds it
        drain(harness, c, "q", 3)
    else:
        drain(harness, c, "q", 3)
        assert not p.held_by and p.incomplete(held) == held  # the store still holds it
        release(harness, store, tokens(store.take()))
    assert not p.incomplete(held)


def test_a_fanout_is_held_once_per_holder_for_the_whole_transfer(harness: Harness):
    p = harness.connect().session()
    for name in ("a", "b", "c"):
        p.declare_queue(name)
        p.call(P.EXCHANGE_BIND, "amq.fanout", name, "")
    store, other = harness.broker.add_holder("store"), harness.broker.add_holder("other")
    queues = harness.broker.queues
    queues["a"].add_holder(store)
    queues["b"].add_holder(other)
    queues["c"].add_holder(store)
    ids = send(harness, p, "", 2, exchange="amq.fanout")
    held = store.take()
    # one hold per transfer, covering both of its queues that carry the store: one sync covers the transfer
    assert [[(q.name, seq_of(e)) for q, e in messages] for _, messages in held] == [
        [("a", 1), ("c", 1)], [("a", 2), ("c", 2)]]
    release(harness, store, tokens(held))
    assert p.incomplete(ids) == ids  # the other holder has not let go
    release(harness, other, tokens(other.take()))
    assert not p.incomplete(ids)


def test_removing_the_holder_completes_what_it_held(harness: Harness):
    p = harness.connect().session()
    p.declare_queue("q")
    p.declare_queue("r", STOP_AT_2)
    store = harness.broker.add_holder("store")
    harness.broker.queues["q"].add_holder(store)
    harness.broker.queues["r"].add_holder(store)
    on_q = send(harness, p, "q", 2)
    on_r = send(harness, p, "r", 3)  # the third is held by r's flow control as well
    held = store.take()
    harness.broker.remove_holder(store)
    harness.run()
    assert not p.incomplete(on_q) and p.incomplete(on_r) == on_r[2:]
    assert store.removed and store.take() == [] and harness.broker.queues["q"].holders == ()
    store.release(tokens(held))  # after removal: nothing to do, nothing refused
    after = send(harness, p, "q", 1)
    assert not p.incomplete(after)  # no queue carries it now
    with pytest.raises(ValueError, match="holder 'store' was removed already"):
        harness.broker.remove_holder(store)
    with pytest.raises(ValueError, match="queue 'q': holder 'store' was removed"):
        harness.broker.queues["q"].add_holder(store)


def test_a_session_that_closes_while_held(harness: Harness):
    producer, other = harness.connect(), harness.connect()
    p, o = producer.session("p"), other.session("o")
    p.declare_queue("q")
    store = harness.broker.add_holder("store")
    harness.broker.queues["q"].add_holder(store)
    send(harness, p, "q", 2)
    kept = send(harness, o, "q", 1)
    held = store.take()
    broker = harness.broker
    slots = {ssn.name: slot for slot, ssn in broker.sessions.items()}
    p.command(P.DETACH)  # the producer goes away while the store holds its transfers
    harness.run()
    assert slots["p"] not in broker.sessions
    assert broker.acct.stats(store.slot)[4] == 1  # the closed session's holds are forgotten
    assert broker.queues["q"].count == 3  # its messages stay
    completed = []
    apply = broker.completion.apply
    broker.completion.apply = lambda: completed.extend(apply()) or completed
    release(harness, store, tokens(held))  # the closed session's tokens are stale: ignored
    assert not o.incomplete(kept)
    assert [c[0] for c in completed] == [slots["o"]]  # nothing for the closed session


def test_a_queue_that_stops_carrying_a_holder(harness: Harness):
    p = harness.connect().session()
    p.declare_queue("q")
    store = harness.broker.add_holder("store")
    q = harness.broker.queues["q"]
    q.add_holder(store)
    q.add_holder(store)  # once is enough
    assert q.holders == (store,) and q.special
    held = send(harness, p, "q", 1)
    q.remove_holder(store)
    assert q.holders == () and not q.special
    free = send(harness, p, "q", 1)
    assert p.incomplete(held + free) == held  # what it holds stays held until released
    release(harness, store, tokens(store.take()))
    assert not p.incomplete(held)


def test_a_ring_queue_with_a_holder_still_trims(harness: Harness):
    p = harness.connect().session()
    p.declare_queue("r", {"qpid.max_count": 2, "qpid.policy_type": "ring"})
    store = harness.broker.add_holder("store")
    harness.broker.queues["r"].add_holder(store)
    ids = send(harness, p, "r", 4)
    r = harness.broker.queues["r"]
    assert (r.count, r.discards_ring) == (2, 2) and p.incomplete(ids) == ids
    release(harness, store, tokens(store.take()))
    assert not p.incomplete(ids)


def test_a_queue_without_holders_logs_what_it_did(harness: Harness):
    """The path without holders is unchanged: one OP_TRANSFER1 per transfer to one plain queue, and a
    fanout's transfer is OP_TRANSFER, its enqueues, OP_END; with a holder, OP_HOLD comes before OP_END."""
    broker = harness.broker
    p = harness.connect().session()
    for name in ("a", "b"):
        p.declare_queue(name)
        p.call(P.EXCHANGE_BIND, "amq.fanout", name, "")
    ssn = next(iter(broker.sessions.values()))
    codes = []
    apply = broker.completion.apply

    def spy():
        codes.extend(broker.oplog.op_codes())
        return apply()

    broker.completion.apply = spy
    broker.transfer(ssn, ssn.commands.next_id, "", "a", None, b"x")
    broker.transfer(ssn, ssn.commands.next_id + 1, "amq.fanout", "", None, b"x")
    broker.flush()
    assert codes[:5] == [OP_TRANSFER1, OP_TRANSFER, OP_ENQUEUE, OP_ENQUEUE, OP_END]
    assert not broker.queues["a"].special
    broker.queues["b"].add_holder(broker.add_holder("store"))
    codes.clear()
    broker.transfer(ssn, ssn.commands.next_id + 2, "amq.fanout", "", None, b"x")
    broker.flush()
    assert codes[:5] == [OP_TRANSFER, OP_ENQUEUE, OP_ENQUEUE, OP_HOLD, OP_END]


def test_a_release_names_what_is_not_a_token(harness: Harness):
    store = harness.broker.add_holder("store")
    with pytest.raises(ValueError, match=r"holder 'store': 1\.5 is not a hold token"):
        store.release([1.5])
    with pytest.raises(ValueError, match=f"holder 'store': {1 << 64} is not a hold token"):
        store.release([1 << 64])


def reported(ssn) -> list[int]:
    """The command ids the broker has reported complete to ``ssn`` since the last call."""
    ids = []
    for frame in msgpack.Unpacker(io.BytesIO(ssn.out.take()), raw=False):
        if frame[0] == P.COMPLETED:
            ids += RangeSet.from_wire(frame[2])
    return ids


def test_wake_is_called_once_per_apply_that_gave_the_holder_holds():
    """Without the harness: the broker's calls as a connection and a store make them."""
    broker = Broker()
    ssn = broker.open_session(0, "s")
    q, _ = broker.declare_queue("q")
    woken = []
    store = broker.add_holder("store", wake=lambda: woken.append(len(store.arrived)))
    q.add_holder(store)
    for cid in range(3):
        broker.transfer(ssn, cid, "", "q", None, b"m")
    broker.flush()
    assert woken == [3] and reported(ssn) == []  # woken once, with all three waiting
    broker.transfer(ssn, 3, "", "nowhere", None, b"m")
    broker.flush()
    assert woken == [3] and reported(ssn) == [3]  # no queue, no holder
    held = store.take()
    store.release([held[1][0]])
    assert reported(ssn) == []  # a release is an op in the log: nothing until the next apply
    broker.flush()
    assert reported(ssn) == [1]
    broker.remove_holder(store)
    assert reported(ssn) == [0, 2] and woken == [3]


def test_a_carried_holder_holds_present_and_future_queues_that_match_until_removed(harness: Harness):
    """Broker.carry: the rule a holder is carried by (the store: durable queues;
    the memory alarm: every queue) applies to the queues there now and to those
    declared later, each told to ``attached`` once; removing the holder ends it.
    A holder told of deletions hears of a carried queue's deletion."""
    b = harness.broker
    p = harness.connect().session()
    p.declare_queue("d1", {})
    p.call(P.QUEUE_DECLARE, "t1", False, False, False, {}, False)
    attached, deleted = [], []
    holder = b.add_holder("store", deleted=lambda q: deleted.append(q.name))
    b.carry(holder, lambda q: q.name.startswith("d"), lambda q: attached.append(q.name))
    p.declare_queue("d2", {})
    p.declare_queue("t2", {})
    assert attached == ["d1", "d2"]
    assert [name for name, q in b.queues.items() if holder in q.holders] == ["d1", "d2"]
    p.call(P.QUEUE_DELETE, "d2", False, False)
    p.call(P.QUEUE_DELETE, "t2", False, False)
    assert deleted == ["d2"]
    b.remove_holder(holder)
    p.declare_queue("d3", {})
    assert attached == ["d1", "d2"] and not any(holder in q.holders for q in b.queues.values())
