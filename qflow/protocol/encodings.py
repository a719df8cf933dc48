"""Byte-level encodings written or peeked at outside a msgpack Packer. No I/O.

Most frames are written by :class:`~qflow.protocol.framing.FrameEncoder` from
lists. The per-message paths instead append bytes they encoded once and cached
(a sender's plain transfer head, a subscription's delivery heads), or look at a
frame's first bytes before decoding it (the broker's transfer runs). Every such
encoding is built here, from msgpack's own encoding of each field, so it is
exactly what the Packer would have written; ``tests/test_protocol_connection.py``
compares them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from struct import Struct
from typing import Any

import msgpack

from qflow.protocol.entries import ENTRY_HEAD, REDELIVERED_NO, REDELIVERED_YES
from qflow.protocol.spec import DELIVER, DELIVER_PART, DELIVER_RUN, TRANSFER

# A message.transfer is an array of six: msgpack's fixarray header for 6, then
# the code 30 as a positive fixint. A frame whose first two bytes are these is
# a transfer encoded the usual way (docs/protocol.md, "Fastest transfer encoding").
TRANSFER_FIXARRAY = 0x96
NIL = b"\xc0"

_packb = msgpack.packb  # not a shared Packer: these run rarely, maybe in threads (Spark)


def bin_header(n: int) -> bytes:
    """msgpack's bin header for ``n`` bytes, as the Packer writes it."""
    if n < 0x100:
        return bytes((0xC4, n))
    if n < 0x10000:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def transfer_head(channel: int) -> bytes:
    """The first bytes of a message.transfer on ``channel``: ``[30, channel, ...``.
    What follows them in such a frame is what the broker stores."""
    return bytes((TRANSFER_FIXARRAY,)) + _packb(TRANSFER) + _packb(channel)


def transfer_prefix(channel: int, exchange: str, routing_key: str, properties: dict[str, Any] | None) -> bytes:
    """A message.transfer's bytes up to its body's bin header: the frame is
    this, then :func:`bin_header` of the body's size, then the body."""
    return transfer_head(channel) + _packb(exchange) + _packb(routing_key) + (
        NIL if properties is None else _packb(properties))


def str_header(n: int) -> bytes:
    """msgpack's str header for ``n`` bytes of UTF-8, as the Packer writes it."""
    if n < 32:
        return bytes((0xA0 | n,))
    if n < 0x100:
        return bytes((0xD9, n))
    if n < 0x10000:
        return b"\xda" + n.to_bytes(2, "big")
    return b"\xdb" + n.to_bytes(4, "big")


ID_KEY = _packb("message_id")


def transfer_prefix_around_id(channel: int, exchange: str, routing_key: str,
                              properties: dict[str, Any] | None) -> tuple[bytes, bytes]:
    """``(before, after)``: a message.transfer whose properties are
    ``properties`` with a ``message_id`` of its own is ``before``, the id (a
    msgpack str), ``after``, then the body's :func:`bin_header` and the body.
    The id is the map's first key, as the client always writes it: frames that
    differ only there make one run for the broker (native/transfers.h)."""
    rest = {k: v for k, v in (properties or {}).items() if k != "message_id"}
    whole = transfer_prefix(channel, exchange, routing_key, {"message_id": "", **rest})
    at = len(transfer_head(channel) + _packb(exchange) + _packb(routing_key)) + 1 + len(ID_KEY)  # 1: a fixmap
    assert whole[at - len(ID_KEY):at + 1] == ID_KEY + b"\xa0", "message_id is not the map's first key"
    return whole[:at], whole[at + 1:]


def deliver_head(channel: int, destination: str) -> bytes:
    """message.deliver's first bytes, up to its delivery id: ``[18, channel,
    destination, ...`` (an array of 11)."""
    return b"\x9b" + _packb(DELIVER) + _packb(channel) + _packb(destination)


def deliver_run_head(channel: int, destination: str) -> bytes:
    """message.deliver-run's first bytes, up to its first delivery id:
    ``[20, channel, destination, ...`` (an array of 6)."""
    return b"\x96" + _packb(DELIVER_RUN) + _packb(channel) + _packb(destination)


def deliver_packer(channel: int, destination: str) -> Callable[[int, int], bytes]:
    """``pack(0xCF, delivery_id)``: :func:`deliver_head` and the delivery id (a
    u64), the bytes a broker writes before the stored entry."""
    head = deliver_head(channel, destination)
    return partial(Struct(f">{len(head)}sBQ").pack, head)


def deliver_run_packer(channel: int, destination: str) -> tuple[Callable[..., bytes], int]:
    """``(pack, size)``: ``pack(0xCF, first_id, 0xCE, count, 0xC6, nbytes)`` is a
    message.deliver-run frame up to its blob of ``nbytes`` of entries (u64 first
    delivery id, u32 count, bin32 header), and ``size`` is how long that is."""
    head = deliver_run_head(channel, destination)
    struct = Struct(f">{len(head)}sBQBIBI")
    return partial(struct.pack, head), struct.size


def deliver_part_head(channel: int, destination: str) -> bytes:
    """message.deliver-part's first bytes, up to its delivery id:
    ``[21, channel, destination, ...`` (an array of 6)."""
    return b"\x96" + _packb(DELIVER_PART) + _packb(channel) + _packb(destination)


def deliver_part_packer(channel: int, destination: str) -> tuple[Callable[..., bytes], int]:
    """``(pack, size)``: ``pack(0xCF, delivery_id, more, 0xC6, nbytes)`` is a
    message.deliver-part frame up to its chunk of ``nbytes`` (u64 delivery id,
    ``more`` 0xC3 (true) on every part but the last (0xC2, false), bin32
    header), and ``size`` is how long that is."""
    head = deliver_part_head(channel, destination)
    struct = Struct(f">{len(head)}sBQBBI")
    return partial(struct.pack, head), struct.size


def entry_of_deliver(frame: list[Any]) -> tuple[int, bytes]:
    """A message.deliver frame's delivery id and its message as a stored entry
    (qflow.protocol.entries): a broker that sends one delivery per frame is
    read as one that sends runs of one. Raises ValueError (or TypeError) for
    a frame with the wrong fields."""
    _, _, _, did, redelivered, seq, _size, exchange, key, props, body = frame
    fields = _packb(exchange) + _packb(key) + _packb(props)
    # The entry's size is counted from the fields as encoded again here: the
    # frame's size counts them as the sender encoded them, maybe wider.
    head = ENTRY_HEAD.pack(REDELIVERED_YES if redelivered else REDELIVERED_NO, 0xCF, seq, 0xCF, len(fields) + len(body))
    return did, head + fields + _packb(body)
