"""Exchanges: direct, fanout and topic routing, sans-I/O."""

from __future__ import annotations

import pytest

from qflow.broker.exchange import new_exchange, topic_matches

pytestmark = pytest.mark.native_only  # no accounting here: nothing differs under QFLOW_ACCOUNTING=python


class Q:
    """A stand-in queue: routing only needs identity."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Q({self.name})"


def names(queues: list) -> list[str]:
    return [q.name for q in queues]


def test_unknown_type_refused() -> None:
    with pytest.raises(ValueError, match="direct, fanout, topic"):
        new_exchange("x", "headers")


# -- direct --------------------------------------------------------------------------------------------------


def test_direct_routes_on_exact_key() -> None:
    ex = new_exchange("amq.direct", "direct")
    a, b, c = Q("a"), Q("b"), Q("c")
    assert ex.bind(a, "k1")
    assert ex.bind(b, "k2")
    assert ex.bind(c, "k1")
    assert names(ex.route("k1")) == ["a", "c"]  # bind order
    assert names(ex.route("k2")) == ["b"]
    assert ex.route("k3") == []
    assert ex.route("K1") == []
    assert ex.route("k1.x") == []
    assert ex.route("") == []


def test_direct_duplicate_bind() -> None:
    ex = new_exchange("d", "direct")
    a = Q("a")
    assert ex.bind(a, "k")
    assert not ex.bind(a, "k")
    assert names(ex.route("k")) == ["a"]
    assert ex.binding_count == 1


# -- fanout --------------------------------------------------------------------------------------------------


def test_fanout_routes_to_every_bound_queue_once() -> None:
    ex = new_exchange("amq.fanout", "fanout")
    a, b = Q("a"), Q("b")
    assert ex.route("anything") == []
    ex.bind(a, "")
    ex.bind(b, "x")
    ex.bind(a, "y")  # a second binding for a
    assert names(ex.route("anything")) == ["a", "b"]
    assert names(ex.route("")) == ["a", "b"]


def test_fanout_cache_invalidated() -> None:
    ex = new_exchange("f", "fanout")
    a, b = Q("a"), Q("b")
    ex.bind(a, "")
    assert names(ex.route("k")) == ["a"]
    ex.bind(b, "")
    assert names(ex.route("k")) == ["a", "b"]
    ex.unbind(a, "")
    assert names(ex.route("k")) == ["b"]
    ex.unbind(b, "")
    assert ex.route("k") == []


# -- topic ---------------------------------------------------------------------------------------------------

TOPIC_CASES = [
    # pattern, routing key, matches
    ("a.b.c", "a.b.c", True),
    ("a.b.c", "a.b", False),
    ("a.b.c", "a.b.c.d", False),
    ("a", "ab", False),
    ("a.*.c", "a.b.c", True),
    ("a.*.c", "a.xyz.c", True),
    ("a.*.c", "a.c", False),  # * is exactly one word
    ("a.*.c", "a.b.b.c", False),
    ("a.*.c", "b.b.c", False),
    ("*", "a", True),
    ("*", "a.b", False),
    ("*", "", False),  # * does not match the empty key
    ("*.*", "a", False),
    ("*.*", "a.b", True),
    ("#", "", True),
    ("#", "a", True),
    ("#", "a.b.c", True),
    ("a.#", "a", True),  # # matches zero words
    ("a.#", "a.b", True),
    ("a.#", "a.b.c", True),
    ("a.#", "b.a", False),
    ("a.#", "ab", False),
    ("#.c", "c", True),
    ("#.c", "a.b.c", True),
    ("#.c", "c.d", False),
    ("a.#.c", "a.c", True),  # zero words between
    ("a.#.c", "a.b.c", True),
    ("a.#.c", "a.b.d.c", True),
    ("a.#.c", "a.b.d", False),
    ("a.#.c", "a.c.d", False),
    ("#.#", "", True),
    ("#.#", "a.b", True),
    ("*.#", "a", True),
    ("*.#", "", False),
    ("#.*", "", False),
    ("#.*", "a.b.c", True),
    ("a.*.#", "a", False),
    ("a.*.#", "a.b", True),
    ("a.*.#", "a.b.c.d", True),
    ("#.b.#", "b", True),
    ("#.b.#", "a.b.c", True),
    ("#.b.#", "a.c", False),
    ("", "", True),
    ("", "a", False),
    ("a", "", False),
]


@pytest.mark.parametrize(("pattern", "key", "match"), TOPIC_CASES)
def test_topic_routing(pattern: str, key: str, match: bool) -> None:
    ex = new_exchange("amq.topic", "topic")
    q = Q("q")
    ex.bind(q, pattern)
    assert ex.route(key) == ([q] if match else []), f"{pattern!r} vs {key!r}"


def test_topic_matches_on_words() -> None:
    assert topic_matches(["a", "#", "c"], ["a", "c"])
    assert topic_matches(["a", "#", "c"], ["a", "x", "y", "c"])
    assert not topic_matches(["a", "*"], ["a"])
    assert topic_matches(["#"], [])
    assert not topic_matches(["*"], [])


def test_topic_queue_bound_twice_receives_once() -> None:
    ex = new_exchange("t", "topic")
    a, b = Q("a"), Q("b")
    ex.bind(a, "a.*")
    ex.bind(a, "*.b")
    ex.bind(a, "#")
    ex.bind(b, "a.b")
    assert names(ex.route("a.b")) == ["a", "b"]
    assert names(ex.route("a.x")) == ["a"]
    assert names(ex.route("z")) == ["a"]


def test_topic_cache_invalidated_on_bind_and_unbind() -> None:
    ex = new_exchange("t", "topic")
    a, b = Q("a"), Q("b")
    ex.bind(a, "x.*")
    assert names(ex.route("x.y")) == ["a"]  # now cached
    ex.bind(b, "#.y")
    assert names(ex.route("x.y")) == ["a", "b"]
    ex.unbind(a, "x.*")
    assert names(ex.route("x.y")) == ["b"]
    ex.unbind_queue(b)
    assert ex.route("x.y") == []


def test_topic_many_routing_keys() -> None:
    ex = new_exchange("t", "topic")
    a = Q("a")
    ex.bind(a, "k.*")
    for i in range(10050):  # past the cache bound
        assert ex.route(f"k.{i}") == [a]
    assert ex.route("other.1") == []


# -- bindings ------------------------------------------------------------------------------------------------


def test_unbind_and_binding_count() -> None:
    ex = new_exchange("t", "topic")
    a, b = Q("a"), Q("b")
    assert ex.binding_count == 0
    ex.bind(a, "k")
    ex.bind(a, "j")
    ex.bind(b, "k")
    assert not ex.bind(b, "k")
    assert ex.binding_count == 3
    assert sorted((k, q.name) for k, q in ex.bindings()) == [("j", "a"), ("k", "a"), ("k", "b")]
    assert ex.unbind(a, "k")
    assert not ex.unbind(a, "k")  # already gone
    assert not ex.unbind(a, "nope")
    assert not ex.unbind(Q("c"), "j")
    assert ex.binding_count == 2
    assert names(ex.route("k")) == ["b"]
    assert names(ex.route("j")) == ["a"]
    assert ex.unbind_queue(a) == 1
    assert ex.unbind_queue(a) == 0
    assert ex.binding_count == 1
    assert ex.route("j") == []
    assert ex.unbind(b, "k")
    assert ex.binding_count == 0
    assert ex.bindings() == []


def test_direct_unbind() -> None:
    ex = new_exchange("d", "direct")
    a, b = Q("a"), Q("b")
    ex.bind(a, "k")
    ex.bind(b, "k")
    assert ex.unbind(a, "k")
    assert names(ex.route("k")) == ["b"]
    assert ex.unbind(b, "k")
    assert ex.route("k") == []
    assert ex.binding_count == 0
