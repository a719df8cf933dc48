"""The first bytes of the frames that the per-message paths write or recognise
without msgpack's help: a session's transfers, and a consumer's
message.deliver and message.deliver-run frames. Built once (per session or
subscription) from msgpack's own encoding, so they cannot drift from it; see
docs/protocol.md for the frames themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from struct import Struct

import msgpack

from qflow.protocol.spec import DELIVER, DELIVER_RUN, TRANSFER

# msgpack fixarray headers: a transfer has 6 items, a deliver 11, a deliver-run 6.
_FIXARRAY = 0x90


def _fixarray(n: int) -> bytes:
    return bytes([_FIXARRAY | n])


def transfer_head(channel: int) -> bytes:
    """How ``[TRANSFER, channel, exchange, routing_key, properties, body]``
    begins when msgpack encodes it (the client's senders, msgpack-python)."""
    return _fixarray(6) + msgpack.packb(TRANSFER) + msgpack.packb(channel)


def deliver_head(channel: int, destination: str) -> Callable[[int, int], bytes]:
    """``pack(0xCF, delivery_id)``: a message.deliver frame up to and including
    its delivery id (a u64); the stored entry follows (qflow.protocol.entries)."""
    head = _fixarray(11) + msgpack.packb(DELIVER) + msgpack.packb(channel) + msgpack.packb(destination)
    return partial(Struct(f">{len(head)}sBQ").pack, head)


def deliver_run_head(channel: int, destination: str) -> tuple[Callable[..., bytes], int]:
    """``(pack, size)``: ``pack(0xCF, first_id, 0xCE, count, 0xC6, nbytes)`` is a
    message.deliver-run frame up to its blob of ``nbytes`` of entries (u64 first
    delivery id, u32 count, bin32 header), and ``size`` is how long that is."""
    head = _fixarray(6) + msgpack.packb(DELIVER_RUN) + msgpack.packb(channel) + msgpack.packb(destination)
    struct = Struct(f">{len(head)}sBQBIBI")
    return partial(struct.pack, head), struct.size
