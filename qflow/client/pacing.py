"""Rate limiting for senders and receivers (HornetQ's producer- and
consumer-max-rate)."""

from __future__ import annotations

import trio

PACE_SLACK = 0.002  # a rate limiter sleeps only once this far ahead of its schedule


async def pace(previous: float, interval: float) -> float:
    """The slot of the next operation is ``interval`` after the previous
    one's (``previous``); returns it, after sleeping until it if need be. A
    sleep costs about a millisecond whatever its length, so sleeping per
    message would cap the rate near 1000/s: sleep only when ``PACE_SLACK``
    ahead. Idle time earns no burst."""
    now = trio.current_time()
    slot = previous + interval
    if slot < now:
        slot = now
    if slot - now > PACE_SLACK:
        await trio.sleep_until(slot)
    return slot
