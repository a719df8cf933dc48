"""Queues, their entries and consumers. No I/O.

A queue holds its available entries in FIFO order and counts every message
enqueued and not yet dequeued (available plus acquired-but-unaccepted): that
is its depth, ``msgDepth``/``byteDepth``. It knows nothing of flow control:
the broker reports each enqueue and dequeue to the accounting, which keeps
its own counts and decides (``qflow.accounting``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from qflow.flow import QueueSettings


class Message:
    """What a producer sent: shared by every queue the transfer reached."""

    __slots__ = ("exchange", "routing_key", "properties", "body")

    def __init__(self, exchange: str, routing_key: str, properties: dict | None, body: bytes) -> None:
        self.exchange = exchange
        self.routing_key = routing_key
        self.properties = properties
        self.body = body


class Entry:
    """One message on one queue."""

    __slots__ = ("message", "size", "token", "redelivered", "seq")

    def __init__(self, message: Message, size: int, seq: int) -> None:
        self.message = message
        self.size = size
        self.token = -1  # the accounting's hold token while the transfer is held here
        self.redelivered = False
        self.seq = seq


class Consumer:
    __slots__ = ("session", "destination", "queue", "accept_mode", "acquire_mode", "credit", "byte_credit")

    def __init__(self, session: Any, destination: str, queue: Queue, accept_mode: int, acquire_mode: int) -> None:
        self.session = session
        self.destination = destination
        self.queue = queue
        self.accept_mode = accept_mode
        self.acquire_mode = acquire_mode
        self.credit = 0  # messages; -1 = unlimited
        self.byte_credit = 0  # bytes; -1 = unlimited

    def can_take(self, size: int) -> bool:
        return self.credit != 0 and (self.byte_credit < 0 or self.byte_credit >= size)


class Queue:
    __slots__ = (
        "name", "durable", "exclusive", "auto_delete", "arguments", "settings", "owner", "slot",
        "entries", "acquired", "consumers", "next_consumer", "count", "nbytes", "next_seq",
        "total_enqueues", "total_dequeues", "byte_total_enqueues", "byte_total_dequeues",
        "discards_ring", "discards_overflow", "binding_count", "had_consumer", "deleted",
        "held_sessions", "writers",
    )

    def __init__(
        self, name: str, durable: bool, exclusive: bool, auto_delete: bool, arguments: dict[str, Any],
        settings: QueueSettings, slot: int, owner: Any = None,
    ) -> None:
        self.name = name
        self.durable = durable
        self.exclusive = exclusive
        self.auto_delete = auto_delete
        self.arguments = arguments
        self.settings = settings
        self.owner = owner
        self.slot = slot  # the accounting's queue slot
        self.entries: deque[Entry] = deque()
        self.acquired: dict[int, Entry] = {}  # seq -> entry delivered, not yet accepted
        self.consumers: list[Consumer] = []
        self.next_consumer = 0
        self.count = 0
        self.nbytes = 0
        self.next_seq = 1
        self.total_enqueues = 0
        self.total_dequeues = 0
        self.byte_total_enqueues = 0
        self.byte_total_dequeues = 0
        self.discards_ring = 0
        self.discards_overflow = 0
        self.binding_count = 1  # the default exchange's binding
        self.had_consumer = False
        self.deleted = False
        self.held_sessions: set[Any] = set()  # sessions told their transfers are held here
        self.writers: dict[Any, int] = {}  # session -> its announced sender capacity

    def over_limit(self, size: int) -> bool:
        """Would one more message of ``size`` bytes exceed the queue's limits?"""
        s = self.settings
        return (s.max_count > 0 and self.count >= s.max_count) or (s.max_size > 0 and self.nbytes + size > s.max_size)

    def oldest_is_acquired(self) -> bool:
        if not self.acquired:
            return False
        return not self.entries or min(self.acquired) < self.entries[0].seq

    def put_back(self, entry: Entry) -> None:
        """Return an acquired entry to its place in FIFO order (release, session close)."""
        del self.acquired[entry.seq]
        entries = self.entries
        if not entries or entries[0].seq > entry.seq:
            entries.appendleft(entry)
            return
        i = 0
        for i, other in enumerate(entries):  # noqa: B007 - rare path: a release behind newer ones
            if other.seq > entry.seq:
                break
        else:
            i = len(entries)
        entries.insert(i, entry)

    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "durable": self.durable,
            "autoDelete": self.auto_delete,
            "exclusive": self.exclusive,
            "arguments": self.arguments,
            "msgDepth": self.count,
            "byteDepth": self.nbytes,
            "msgTotalEnqueues": self.total_enqueues,
            "msgTotalDequeues": self.total_dequeues,
            "byteTotalEnqueues": self.byte_total_enqueues,
            "byteTotalDequeues": self.byte_total_dequeues,
            "consumerCount": len(self.consumers),
            "bindingCount": self.binding_count,
            "discardsRing": self.discards_ring,
            "discardsOverflow": self.discards_overflow,
            "maxCount": self.settings.max_count,
            "maxSize": self.settings.max_size,
            "policyType": self.settings.policy,
            "firstSequence": self.entries[0].seq if self.entries else self.next_seq,
            "lastSequence": self.next_seq - 1,
        }
