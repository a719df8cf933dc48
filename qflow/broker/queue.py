"""Queues, their entries and consumers. No I/O.

A queue holds its available entries in FIFO order and counts every message
enqueued and not yet dequeued (available plus acquired-but-unaccepted): that
is its depth, ``msgDepth``/``byteDepth``. It knows nothing of flow control:
the broker reports each enqueue and dequeue to the accounting, which keeps
its own counts and decides (``qflow.broker.accounting``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from qflow.broker.flow import QueueSettings
from qflow.protocol.entries import (  # noqa: F401 - the entry format is the queue's storage format
    ENTRY_HEAD,
    ENTRY_HEAD_SIZE,
    REDELIVERED_NO,
    REDELIVERED_YES,
    Entry,
    entry_tail,
    redelivered,
    seq_and_size,
    seq_of,
)


class Consumer:
    __slots__ = ("session", "destination", "queue", "accept_mode", "acquire_mode", "credit", "byte_credit", "cursor",
                 "head", "run_head", "run_cap")

    def __init__(self, session: Any, destination: str, queue: Queue, accept_mode: int, acquire_mode: int) -> None:
        self.session = session
        self.destination = destination
        self.queue = queue
        self.accept_mode = accept_mode
        self.acquire_mode = acquire_mode
        self.credit = 0  # messages; -1 = unlimited
        self.byte_credit = 0  # bytes; -1 = unlimited
        self.cursor = 0  # a browser's next sequence number to deliver
        self.head: Any = None  # head(0xCF, delivery_id): its message.deliver frames' first bytes (set by the broker)
        # When its connection takes message.deliver-run frames: run_head(0xCF, first_id, 0xCE, count, 0xC6,
        # entry_bytes), their first bytes, and the most entry bytes one may carry.
        self.run_head: Any = None
        self.run_cap = 0

    def can_take(self, size: int) -> bool:
        return self.credit != 0 and (self.byte_credit < 0 or self.byte_credit >= size)


class Queue:
    __slots__ = (
        "name", "durable", "exclusive", "auto_delete", "arguments", "settings", "owner", "slot",
        "entries", "tokens", "consumers", "next_consumer", "count", "nbytes", "next_seq",
        "total_dequeues", "byte_total_dequeues", "max_count", "max_size", "ring",
        "discards_ring", "discards_overflow", "binding_count", "had_consumer", "deleted",
        "held_sessions", "writers", "route", "worst_warned", "browsers",
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
        self.max_count = settings.max_count  # copied from settings for the per-message path
        self.max_size = settings.max_size
        self.ring = settings.is_ring
        self.owner = owner
        self.slot = slot  # the accounting's queue slot
        self.entries: deque[Entry] = deque()
        # seq -> the accounting's hold token, for messages whose transfer is held
        # here: only while this queue's flow is stopped.
        self.tokens: dict[int, int] = {}
        self.consumers: list[Consumer] = []  # they acquire: each message goes to one
        self.browsers: list[Consumer] = []  # they see every message and take none
        self.next_consumer = 0
        self.count = 0
        self.nbytes = 0
        self.next_seq = 1
        self.total_dequeues = 0
        self.byte_total_dequeues = 0
        self.discards_ring = 0
        self.discards_overflow = 0
        self.binding_count = 1  # the default exchange's binding
        self.had_consumer = False
        self.deleted = False
        self.held_sessions: set[Any] = set()  # sessions told their transfers are held here
        self.writers: dict[Any, int] = {}  # session -> its announced sender capacity
        self.route = (self,)  # the default exchange's routing result, made once
        self.worst_warned = False

    def set_settings(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.max_count = settings.max_count
        self.max_size = settings.max_size
        self.ring = settings.is_ring

    @property
    def total_enqueues(self) -> int:
        return self.next_seq - 1  # every enqueue took one sequence number

    @property
    def byte_total_enqueues(self) -> int:
        return self.byte_total_dequeues + self.nbytes

    def over_limit(self, size: int) -> bool:
        """Would one more message of ``size`` bytes exceed the queue's limits?"""
        return (self.max_count > 0 and self.count >= self.max_count) or (
            self.max_size > 0 and self.nbytes + size > self.max_size
        )

    def put_back(self, entry: Entry) -> None:
        """Return an acquired entry to its place in FIFO order (release, session close)."""
        seq = seq_of(entry)
        entries = self.entries
        if not entries or seq_of(entries[0]) > seq:
            entries.appendleft(entry)
            return
        i = 0
        for i, other in enumerate(entries):  # noqa: B007 - rare path: a release behind newer ones
            if seq_of(other) > seq:
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
            "consumerCount": len(self.consumers) + len(self.browsers),
            "bindingCount": self.binding_count,
            "discardsRing": self.discards_ring,
            "discardsOverflow": self.discards_overflow,
            "maxCount": self.settings.max_count,
            "maxSize": self.settings.max_size,
            "policyType": self.settings.policy,
            "firstSequence": seq_of(self.entries[0]) if self.entries else self.next_seq,
            "lastSequence": self.next_seq - 1,
        }
