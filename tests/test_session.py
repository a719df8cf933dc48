"""Session bookkeeping, sans-I/O: command ids, completion ranges, execution.sync."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qflow.protocol.commands import _MISSING, IncomingCommands, OutgoingCommands
from qflow.protocol.ranges import RangeSet
from tests.conftest import examples

pytestmark = pytest.mark.native_only  # no accounting here: nothing differs under QFLOW_ACCOUNTING=python


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Fail instead of hanging if the body iterates a huge range."""
    def alarm(signum, frame):
        raise TimeoutError(f"took more than {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def incoming(n: int) -> IncomingCommands:
    cmds = IncomingCommands()
    assert [cmds.receive() for _ in range(n)] == list(range(n))
    return cmds


# -- IncomingCommands (broker side) --------------------------------------------------------------------------


def test_ids_count_from_zero() -> None:
    cmds = IncomingCommands()
    assert cmds.receive() == 0
    assert cmds.receive() == 1
    assert cmds.receive() == 2
    assert cmds.next_id == 3
    assert not cmds.all_complete
    assert cmds.take_report() is None  # nothing completed yet


def test_in_order_completions_coalesce_into_one_range() -> None:
    cmds = incoming(5)
    for i in range(5):
        cmds.complete(i)
    assert cmds.take_report() == [0, 4]
    assert cmds.take_report() is None  # reported once
    assert cmds.floor == 5
    assert cmds.all_complete


def test_reports_hold_only_what_is_new() -> None:
    cmds = incoming(6)
    cmds.complete(0)
    cmds.complete(1)
    assert cmds.take_report() == [0, 1]
    cmds.complete(2)
    cmds.complete(3)
    assert cmds.take_report() == [2, 3]
    cmds.complete_range(4, 5)
    assert cmds.take_report() == [4, 5]


def test_out_of_order_completion_reported_non_contiguously() -> None:
    cmds = incoming(5)
    cmds.complete(3)
    cmds.complete(1)
    assert cmds.take_report() == [1, 1, 3, 3]
    assert cmds.floor == 0  # 0 is still incomplete
    cmds.complete(4)
    cmds.complete(0)
    assert cmds.take_report() == [0, 0, 4, 4]
    assert cmds.floor == 2
    assert not cmds.all_complete
    cmds.complete(2)
    assert cmds.take_report() == [2, 2]
    assert cmds.floor == 5
    assert cmds.all_complete


def test_a_held_command_does_not_delay_later_ones() -> None:
    cmds = incoming(4)
    for i in (1, 2, 3):  # 0 is held (flow control)
        cmds.complete(i)
    assert cmds.take_report() == [1, 3]
    cmds.complete(0)
    assert cmds.take_report() == [0, 0]
    assert cmds.all_complete


def test_duplicate_completion_does_not_stall_the_floor() -> None:
    cmds = incoming(8)
    for i in range(5):
        cmds.complete(i)
    cmds.complete(2)  # again, e.g. a held transfer released twice
    cmds.complete(5)
    assert cmds.floor == 6
    cmds.sync(cmds.receive())  # id 8 waits for 6 and 7
    cmds.complete_range(6, 7)
    assert cmds.floor == 9
    assert cmds.all_complete


def test_sync_completes_at_once_when_everything_before_is_complete() -> None:
    cmds = incoming(3)
    cmds.complete(0)
    cmds.complete(1)
    cmds.sync(2)
    assert cmds.take_report() == [0, 2]
    assert cmds.all_complete


def test_sync_as_first_command() -> None:
    cmds = incoming(1)
    cmds.sync(0)
    assert cmds.take_report() == [0, 0]


def test_sync_waits_for_every_earlier_command() -> None:
    cmds = incoming(4)  # 0 held, 1 done, 2 held, 3 sync
    cmds.complete(1)
    cmds.sync(3)
    assert cmds.take_report() == [1, 1]
    cmds.complete(0)
    assert cmds.take_report() == [0, 0]  # 2 still incomplete: no sync yet
    assert cmds.floor == 2
    cmds.complete(2)
    assert cmds.take_report() == [2, 3]  # 2, then the sync
    assert cmds.all_complete


def test_several_syncs() -> None:
    cmds = incoming(6)  # 0 held, 1 sync, 2 held, 3 sync, 4 done, 5 sync
    cmds.sync(1)
    cmds.sync(3)
    cmds.complete(4)
    cmds.sync(5)
    assert cmds.take_report() == [4, 4]
    cmds.complete(0)
    assert cmds.take_report() == [0, 1]  # sync 1 done; 3 and 5 wait for 2
    cmds.complete(2)
    assert cmds.take_report() == [2, 3, 5, 5]
    assert cmds.all_complete


def test_several_syncs_released_by_one_completion() -> None:
    cmds = incoming(5)  # 0 held, then four syncs
    for i in range(1, 5):
        cmds.sync(i)
    assert cmds.take_report() is None
    cmds.complete(0)
    assert cmds.take_report() == [0, 4]


def test_thousands_of_pending_syncs() -> None:
    n = 5000
    cmds = incoming(n + 1)
    for i in range(1, n + 1):
        cmds.sync(i)
    cmds.complete(0)
    assert cmds.take_report() == [0, n]
    assert cmds.all_complete


# -- OutgoingCommands (client side) --------------------------------------------------------------------------


def test_outgoing_ids_and_owners() -> None:
    out = OutgoingCommands()
    a, b = object(), object()
    assert out.send(a) == 0
    assert out.send(b) == 1
    assert out.send() == 2
    assert out.incomplete == {0: a, 1: b, 2: None}


def test_completed_returns_newly_completed_with_owner() -> None:
    out = OutgoingCommands()
    owners = [f"sender-{i}" for i in range(5)]
    for o in owners:
        out.send(o)
    assert out.completed([0, 1, 3, 3]) == [(0, "sender-0"), (1, "sender-1"), (3, "sender-3")]
    assert sorted(out.incomplete) == [2, 4]


def test_completed_ignores_already_complete_ids() -> None:
    out = OutgoingCommands()
    for i in range(4):
        out.send(i)
    assert out.completed([0, 1]) == [(0, 0), (1, 1)]
    assert out.completed([0, 1]) == []
    assert out.completed([0, 3]) == [(2, 2), (3, 3)]
    assert out.incomplete == {}
    assert out.completed([0, 3]) == []


def test_completed_ignores_ids_never_sent() -> None:
    out = OutgoingCommands()
    out.send("x")
    assert out.completed([5, 9]) == []
    assert out.completed([0, 9]) == [(0, "x")]


def test_completed_handles_huge_ranges_without_iterating_them() -> None:
    out = OutgoingCommands()
    for i in range(10):
        out.send(i)
    with time_limit(2):
        assert out.completed([3, 2**62]) == [(i, i) for i in range(3, 10)]
        assert out.completed([0, 0, 2, 2**63]) == [(0, 0), (2, 2)]
        assert out.completed([0, 2**63]) == [(1, 1)]
    assert out.incomplete == {}


# -- both sides ----------------------------------------------------------------------------------------------


@settings(max_examples=examples(100), deadline=None)
@given(data=st.data(), n=st.integers(min_value=1, max_value=30))
def test_reports_reach_the_client(data: st.DataObject, n: int) -> None:
    """Broker completes in random order with random syncs and report points; the client learns of every
    command exactly once, and never of a sync before every command before it."""
    is_sync = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    order = data.draw(st.permutations([i for i in range(n) if not is_sync[i]]))
    report_after = data.draw(st.sets(st.integers(min_value=0, max_value=len(order))))

    broker, client = IncomingCommands(), OutgoingCommands()
    for i in range(n):
        assert client.send(f"c{i}") == i
        assert broker.receive() == i
        if is_sync[i]:
            broker.sync(i)
    known = RangeSet()

    def deliver() -> None:
        wire = broker.take_report()
        if wire is None:
            return
        rs = RangeSet.from_wire(wire)
        assert list(rs.ranges()) == sorted(rs.ranges())
        done = client.completed(wire)
        assert sorted(i for i, _ in done) == list(rs)  # nothing reported twice
        assert all(owner == f"c{i}" for i, owner in done)
        for i, _ in done:
            assert i not in known
        known.update(rs)
        for i in rs:
            if is_sync[i]:
                assert all(j in known for j in range(i)), f"sync {i} completed early"

    if 0 in report_after:
        deliver()
    for k, cid in enumerate(order, start=1):
        broker.complete(cid)
        if k in report_after:
            deliver()
    deliver()
    assert broker.all_complete
    assert client.incomplete == {}
    assert list(known) == list(range(n))


def test_completed_counts_groups_by_owner_and_skips_unknown_ids() -> None:
    out = OutgoingCommands()
    a, b = object(), object()
    for owner in (a, a, b, a, None, b):
        out.send(owner)
    assert out.completed_counts([0, 3, 5, 5, 7, 9]) == {a: 3, b: 2}
    assert list(out.incomplete) == [4]
    assert out.completed_counts([0, 5]) == {None: 1}
    assert out.incomplete == {}


class _DictModel:
    """The plain model of OutgoingCommands: one dict entry per incomplete id."""

    def __init__(self) -> None:
        self.next_id = 0
        self.incomplete: dict[int, object] = {}

    def send(self, owner: object) -> int:
        self.incomplete[self.next_id] = owner
        self.next_id += 1
        return self.next_id - 1

    def completed_counts(self, wire: list[int]) -> dict[object, int]:
        counts: dict[object, int] = {}
        for i in range(0, len(wire) - 1, 2):
            for cid in range(wire[i], min(wire[i + 1], self.next_id - 1) + 1):
                if cid in self.incomplete:
                    owner = self.incomplete.pop(cid)
                    counts[owner] = counts.get(owner, 0) + 1
        return counts


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("send"), st.sampled_from(["a", "a", "a", "b", None]), st.integers(1, 20)),
    st.tuples(st.just("complete"), st.lists(st.tuples(st.integers(0, 120), st.integers(0, 30)), max_size=3)),
), max_size=30))
def test_outgoing_runs_match_one_entry_per_id(steps):
    """Ids kept as runs of one owner and completed ranges give what one dict
    entry per id gives: the same counts per owner for any sends and reports
    (in order, out of order, repeated, beyond what was sent), the same
    incomplete ids and owners."""
    out, model = OutgoingCommands(), _DictModel()
    for step in steps:
        if step[0] == "send":
            for _ in range(step[2]):
                assert out.send(step[1]) == model.send(step[1])
        else:
            wire = [x for first, n in sorted(step[1]) for x in (first, first + n)]
            merged = list(RangeSet((wire[i], wire[i + 1]) for i in range(0, len(wire), 2)).ranges())
            wire = [x for r in merged for x in r]
            assert out.completed_counts(wire) == model.completed_counts(wire)
        assert out.incomplete == model.incomplete
        for cid in range(model.next_id + 2):
            owner = out.owner_of(cid)
            assert owner == model.incomplete.get(cid, owner) and (owner is not _MISSING) == (cid in model.incomplete)
