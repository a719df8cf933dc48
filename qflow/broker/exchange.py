"""Exchanges: a registry of types (direct, fanout, topic), each routing a
message to the queues bound to it. No I/O.

Topic binding keys are dot-separated words where ``*`` matches exactly one
word and ``#`` matches zero or more, as in AMQP/Qpid.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from qflow.broker.queue import Queue

class Exchange:
    """An exchange's bindings; each type (below) says how a message routes
    through them. ``route`` takes what routing needs of a message (its routing
    key, and its properties for types that look at them) and returns the
    destination queues, each once: the same list object for the same answer,
    so a caller can tell cheaply that the destinations did not change."""

    __slots__ = ("name", "durable", "_bindings", "_cache", "msg_in", "byte_in", "msg_drop", "byte_drop",
                 "msg_extra", "byte_extra", "arguments", "alternate")
    type = ""

    def __init__(self, name: str, durable: bool = False, arguments: dict[str, Any] | None = None) -> None:
        self.name = name
        self.durable = durable
        self.arguments = arguments or {}
        # Where a message this exchange routes to no queue goes (its ``alternate-exchange``); None: dropped.
        self.alternate: str | None = self.arguments.get(ALTERNATE)
        # Statistics, counted by the broker as it routes (Broker.transfer, transfer_run). Qpid's msgReceives
        # is msg_in, msgDrops msg_drop, and msgRoutes (one per destination queue) is msg_in - msg_drop +
        # msg_extra, where msg_extra counts the copies beyond the first: a message routed to one queue, the
        # common case, costs two additions on the per-message path and no more. The same for bytes.
        self.msg_in = self.byte_in = self.msg_drop = self.byte_drop = self.msg_extra = self.byte_extra = 0
        # binding key -> queues bound with it, in bind order
        self._bindings: dict[str, list[Queue]] = {}
        self._cache: dict[str, list[Queue]] = {}  # routing key -> queues, for types that compute routes

    def bind(self, queue: Queue, key: str) -> bool:
        """Add a binding; False if it already existed."""
        queues = self._bindings.setdefault(key, [])
        if queue in queues:
            return False
        queues.append(queue)
        self._cache.clear()
        return True

    def has_binding(self, queue: Queue, key: str) -> bool:
        return queue in self._bindings.get(key, _EMPTY)

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

    def route(self, routing_key: str, properties: dict | None = None) -> list[Queue]:
        raise NotImplementedError


class DirectExchange(Exchange):
    """A message goes to the queues bound with exactly its routing key."""

    __slots__ = ()
    type = "direct"

    def route(self, routing_key: str, properties: dict | None = None) -> list[Queue]:
        return self._bindings.get(routing_key, _EMPTY)


class FanoutExchange(Exchange):
    """A message goes to every bound queue, whatever its routing key."""

    __slots__ = ()
    type = "fanout"

    def route(self, routing_key: str, properties: dict | None = None) -> list[Queue]:
        cached = self._cache.get("")
        if cached is None:
            cached = self._cache[""] = _unique(q for qs in self._bindings.values() for q in qs)
        return cached


class TopicExchange(Exchange):
    """A message goes to the queues whose binding pattern matches its routing
    key: dot-separated words, ``*`` one word, ``#`` zero or more."""

    __slots__ = ()
    type = "topic"

    def route(self, routing_key: str, properties: dict | None = None) -> list[Queue]:
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


# The registry of exchange types: a new type is a subclass and a line here.
EXCHANGE_TYPES: dict[str, type[Exchange]] = {cls.type: cls for cls in (DirectExchange, FanoutExchange, TopicExchange)}


ALTERNATE = "alternate-exchange"
EXCHANGE_IMPLEMENTED = (ALTERNATE,)


def check_exchange_arguments(arguments: dict[str, Any]) -> None:
    """ValueError, saying what is wrong, unless ``arguments`` are an exchange's
    valid arguments (``alternate-exchange``: an exchange's name; other keys
    are labels, unless qflow.broker.arguments refused them)."""
    alternate = arguments.get(ALTERNATE)
    if ALTERNATE in arguments and (type(alternate) is not str or not alternate):
        raise ValueError(f"{ALTERNATE} must be an exchange's name, not {alternate!r}")


def new_exchange(name: str, type_: str, durable: bool = False, arguments: dict[str, Any] | None = None) -> Exchange:
    """An exchange of the registered type ``type_``; ValueError for an unknown type
    or invalid arguments (:func:`check_exchange_arguments`)."""
    cls = EXCHANGE_TYPES.get(type_)
    if cls is None:
        raise ValueError(f"exchange type must be one of {', '.join(EXCHANGE_TYPES)}, not {type_!r}")
    check_exchange_arguments(arguments or {})
    return cls(name, durable, arguments)


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
