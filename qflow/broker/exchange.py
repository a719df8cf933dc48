"""Exchanges: direct, fanout and topic routing. No I/O.

Topic binding keys are dot-separated words where ``*`` matches exactly one
word and ``#`` matches zero or more, as in AMQP/Qpid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qflow.broker.queue import Queue

EXCHANGE_TYPES = ("direct", "fanout", "topic")


class Exchange:
    __slots__ = ("name", "type", "durable", "_bindings", "_cache")

    def __init__(self, name: str, type_: str, durable: bool = False) -> None:
        if type_ not in EXCHANGE_TYPES:
            raise ValueError(f"exchange type must be one of {', '.join(EXCHANGE_TYPES)}, not {type_!r}")
        self.name = name
        self.type = type_
        self.durable = durable
        # binding key -> queues bound with it, in bind order
        self._bindings: dict[str, list[Queue]] = {}
        self._cache: dict[str, list[Queue]] = {}  # topic: routing key -> queues

    def bind(self, queue: Queue, key: str) -> bool:
        """Add a binding; False if it already existed."""
        queues = self._bindings.setdefault(key, [])
        if queue in queues:
            return False
        queues.append(queue)
        self._cache.clear()
        return True

    def unbind(self, queue: Queue, key: str) -> bool:
        queues = self._bindings.get(key)
        if not queues or queue not in queues:
            return False
        queues.remove(queue)
        if not queues:
            del self._bindings[key]
        self._cache.clear()
        return True

    def unbind_queue(self, queue: Queue) -> int:
        """Remove every binding to ``queue``; return how many there were."""
        removed = 0
        for key in list(self._bindings):
            if self.unbind(queue, key):
                removed += 1
        return removed

    def bindings(self) -> list[tuple[str, Queue]]:
        return [(key, q) for key, queues in self._bindings.items() for q in queues]

    @property
    def binding_count(self) -> int:
        return sum(len(queues) for queues in self._bindings.values())

    def route(self, routing_key: str) -> list[Queue]:
        """The queues a message with ``routing_key`` goes to, each once."""
        if self.type == "direct":
            return self._bindings.get(routing_key, _EMPTY)
        if self.type == "fanout":
            cached = self._cache.get("")
            if cached is None:
                cached = self._cache[""] = _unique(q for qs in self._bindings.values() for q in qs)
            return cached
        cached = self._cache.get(routing_key)
        if cached is None:
            words = _words(routing_key)
            cached = _unique(
                q for key, qs in self._bindings.items() if topic_matches(_words(key), words) for q in qs
            )
            if len(self._cache) > 10000:  # bounded: routing keys may be unbounded
                self._cache.clear()
            self._cache[routing_key] = cached
        return cached


_EMPTY: list = []


def _unique(queues) -> list:
    seen: dict[int, Queue] = {}
    for q in queues:
        seen.setdefault(id(q), q)
    return list(seen.values())


def _words(key: str) -> list[str]:
    """The words of a topic key; the empty key has none (so ``*`` does not match it)."""
    return key.split(".") if key else []


def topic_matches(pattern: list[str], words: list[str]) -> bool:
    """Match topic ``pattern`` words against routing key ``words``."""
    # Dynamic programming over (pattern index, word index); '#' may absorb zero words.
    reachable = {0}
    for p in pattern:
        nxt: set[int] = set()
        for w in reachable:
            if p == "#":
                nxt.update(range(w, len(words) + 1))
            elif w < len(words) and (p == "*" or p == words[w]):
                nxt.add(w + 1)
        if not nxt:
            return False
        reachable = nxt
    return len(words) in reachable
