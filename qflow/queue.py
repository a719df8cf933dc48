"""Queues, their entries and consumers. No I/O.

A queue holds its available entries in FIFO order and counts every message
enqueued and not yet dequeued (available plus acquired-but-unaccepted): that
is its depth, ``msgDepth``/``byteDepth``. It knows nothing of flow control:
the broker reports each enqueue and dequeue to the accounting, which keeps
its own counts and decides (``qflow.accounting``).
"""

from __future__ import annotations

from collections import deque
from struct import Struct
from typing import Any

import msgpack

from qflow.flow import QueueSettings

# An entry, one message on one queue, is one ``bytes`` object: the encoded
# tail of the message.deliver frame that will carry it, from ``redelivered``
# on (see docs/protocol.md). Delivering copies it after a per-delivery head;
# nothing is re-encoded. One untracked object per message costs a third of
# the memory of a list, a tuple and a body, and the garbage collector never
# scans it. Its fixed head:
#
#   byte 0        0xc2 / 0xc3    redelivered (msgpack false / true)
#   bytes 1-9     0xcf + u64     sequence number in the queue
#   bytes 10-18   0xcf + u64     body size
#   bytes 19-     exchange, routing key, properties, body (msgpack, as sent)
Entry = bytes
ENTRY_HEAD = Struct(">BBQBQ")  # pack(REDELIVERED_NO, 0xCF, seq, 0xCF, size)
ENTRY_HEAD_SIZE = ENTRY_HEAD.size
REDELIVERED_NO, REDELIVERED_YES = 0xC2, 0xC3
seq_and_size = Struct(">2xQxQ").unpack_from  # (seq, size) of an entry
_SEQ = Struct(">2xQ").unpack_from


def seq_of(entry: Entry) -> int:
    return _SEQ(entry)[0]


def redelivered(entry: Entry) -> Entry:
    """The entry marked redelivered (a new object: entries are immutable)."""
    return entry if entry[0] == REDELIVERED_YES else b"\xc3" + entry[1:]


def entry_tail(entry: Entry) -> tuple[Any, ...]:
    """(exchange, routing_key, properties, body), decoded (management views, tests)."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(entry[ENTRY_HEAD_SIZE:])
    return tuple(unpacker)


class Consumer:
    __slots__ = ("session", "destination", "queue", "accept_mode", "acquire_mode", "credit", "byte_credit", "cursor",
                 "head")

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
