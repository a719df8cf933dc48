"""RangeSet: ranged sets of ids, as AMQP 0-10 sequence sets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qflow.protocol.ranges import RangeSet
from tests.conftest import examples

pytestmark = pytest.mark.native_only  # no accounting here: nothing differs under QFLOW_ACCOUNTING=python


def test_empty() -> None:
    rs = RangeSet()
    assert not rs
    assert len(rs) == 0
    assert list(rs) == []
    assert rs.to_wire() == []
    assert 0 not in rs
    assert rs.prefix_end() == 0
    assert repr(rs) == "RangeSet([])"


def test_add_in_order_coalesces() -> None:
    rs = RangeSet()
    for i in range(5):
        rs.add(i)
    assert list(rs.ranges()) == [(0, 4)]
    assert rs.to_wire() == [0, 4]
    assert len(rs) == 5
    rs.add(7)
    assert rs.to_wire() == [0, 4, 7, 7]


def test_add_out_of_order() -> None:
    rs = RangeSet()
    for i in (5, 1, 3):
        rs.add(i)
    assert list(rs.ranges()) == [(1, 1), (3, 3), (5, 5)]
    rs.add(2)
    assert list(rs.ranges()) == [(1, 3), (5, 5)]
    rs.add(4)
    assert list(rs.ranges()) == [(1, 5)]
    rs.add(0)
    assert list(rs.ranges()) == [(0, 5)]


def test_add_duplicate_is_a_no_op() -> None:
    rs = RangeSet([(2, 4), (8, 9)])
    rs.add(3)
    rs.add(8)
    rs.add_range(2, 4)
    assert list(rs.ranges()) == [(2, 4), (8, 9)]


def test_adjacent_ranges_merge() -> None:
    rs = RangeSet([(0, 4)])
    rs.add_range(5, 9)
    assert list(rs.ranges()) == [(0, 9)]
    rs = RangeSet([(5, 9)])
    rs.add_range(0, 4)  # before, adjacent
    assert list(rs.ranges()) == [(0, 9)]
    rs = RangeSet([(0, 2), (6, 9)])
    rs.add_range(3, 5)  # fills the gap exactly
    assert list(rs.ranges()) == [(0, 9)]


def test_not_adjacent_stays_separate() -> None:
    rs = RangeSet([(2, 3)])
    rs.add_range(0, 0)
    assert list(rs.ranges()) == [(0, 0), (2, 3)]
    rs.add_range(5, 6)
    assert list(rs.ranges()) == [(0, 0), (2, 3), (5, 6)]


def test_overlapping_ranges_merge() -> None:
    rs = RangeSet([(10, 20), (30, 40)])
    rs.add_range(15, 35)
    assert list(rs.ranges()) == [(10, 40)]
    rs = RangeSet([(0, 1), (3, 4), (6, 7), (9, 10), (20, 21)])
    rs.add_range(2, 8)  # swallows several, touches (9, 10)
    assert list(rs.ranges()) == [(0, 10), (20, 21)]
    rs = RangeSet([(5, 6), (8, 9)])
    rs.add_range(0, 100)  # covers everything
    assert list(rs.ranges()) == [(0, 100)]
    rs = RangeSet([(0, 10)])
    rs.add_range(3, 4)  # inside
    assert list(rs.ranges()) == [(0, 10)]
    rs.add_range(8, 12)  # extends the last
    assert list(rs.ranges()) == [(0, 12)]


def test_contains() -> None:
    rs = RangeSet([(2, 4), (10, 10), (20, 30)])
    inside = {2, 3, 4, 10, *range(20, 31)}
    for i in range(-1, 35):
        assert (i in rs) == (i in inside), i


def test_len_iter_bool_update_clear() -> None:
    rs = RangeSet([(0, 2), (5, 5)])
    assert len(rs) == 4
    assert list(rs) == [0, 1, 2, 5]
    assert rs
    other = RangeSet([(3, 4), (9, 9)])
    rs.update(other)
    assert list(rs.ranges()) == [(0, 5), (9, 9)]
    assert list(other.ranges()) == [(3, 4), (9, 9)]  # unchanged
    rs.clear()
    assert not rs and rs.to_wire() == []


def test_equality() -> None:
    assert RangeSet([(0, 2)]) == RangeSet([(0, 0), (1, 2)])
    assert RangeSet([(0, 2)]) != RangeSet([(0, 3)])
    assert RangeSet() != [0, 2]


def test_wire_round_trip() -> None:
    rs = RangeSet([(0, 4), (7, 7), (2**40, 2**40 + 5)])
    wire = rs.to_wire()
    assert wire == [0, 4, 7, 7, 2**40, 2**40 + 5]
    assert RangeSet.from_wire(wire) == rs
    assert RangeSet.from_wire([]) == RangeSet()


def test_from_wire_normalises() -> None:
    rs = RangeSet.from_wire([5, 6, 0, 2, 3, 4, 1, 1])
    assert list(rs.ranges()) == [(0, 6)]
    assert rs.to_wire() == [0, 6]


@pytest.mark.parametrize("flat", [
    [0], [0, 1, 2],  # odd length
    (0, 1),  # not a list
    "0,1",
    None,
])
def test_from_wire_not_a_flat_pair_list(flat: object) -> None:
    with pytest.raises(ValueError, match="pairs"):
        RangeSet.from_wire(flat)


@pytest.mark.parametrize("flat", [
    [0, 1.0], ["0", 1], [0, None], [True, 1], [0, [1]],  # not ints
    [5, 4], [0, 1, 9, 8],  # last < first
    [-1, 3], [-5, -2],  # negative
])
def test_from_wire_bad_range(flat: list) -> None:
    with pytest.raises(ValueError, match="bad range"):
        RangeSet.from_wire(flat)


def test_prefix_end() -> None:
    rs = RangeSet([(0, 4)])
    assert rs.prefix_end() == 5
    assert rs.prefix_end(3) == 5
    assert rs.prefix_end(5) == 5
    assert rs.prefix_end(9) == 9
    rs = RangeSet([(2, 4)])
    assert rs.prefix_end(0) == 0
    assert rs.prefix_end(2) == 5


def test_prefix_end_beyond_the_first_range() -> None:
    rs = RangeSet([(0, 2), (5, 9), (12, 12)])
    assert rs.prefix_end(5) == 10
    assert rs.prefix_end(7) == 10
    assert rs.prefix_end(3) == 3  # 3 is missing
    assert rs.prefix_end(12) == 13
    assert rs.prefix_end(10) == 10


ops = st.lists(st.tuples(st.integers(min_value=0, max_value=200), st.integers(min_value=0, max_value=12)),
               max_size=40)


@settings(max_examples=examples(200), deadline=None)
@given(ops=ops, probe=st.integers(min_value=0, max_value=215))
def test_matches_a_plain_set(ops: list[tuple[int, int]], probe: int) -> None:
    rs = RangeSet()
    model: set[int] = set()
    for first, length in ops:
        if length == 0:
            rs.add(first)
            model.add(first)
        else:
            rs.add_range(first, first + length - 1)
            model.update(range(first, first + length))
    assert list(rs) == sorted(model)
    assert len(rs) == len(model)
    assert bool(rs) == bool(model)
    for i in range(216):
        assert (i in rs) == (i in model)
    ranges = list(rs.ranges())
    for (f0, l0), (f1, l1) in zip(ranges, ranges[1:], strict=False):
        assert f0 <= l0 < f1 - 1 <= l1 - 1  # sorted, disjoint, not adjacent
    assert RangeSet.from_wire(rs.to_wire()) == rs
    end = probe
    while end in model:
        end += 1
    assert rs.prefix_end(probe) == end
