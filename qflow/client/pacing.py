"""Rate limiting for senders and receivers (HornetQ's producer- and
consumer-max-rate)."""

from __future__ import annotations

import trio

PACE_SLACK = 0.002  # a rate limiter sleeps only once this far ahead of its schedule
PACE_CATCH_UP = 0.01  # ... and makes up at most this much lost time: more is idle time, which earns no burst


async def pace(previous: float, interval: float) -> float:
    """The time slot of a rate-limited operation: ``interval`` after the
    previous one's (``previous``); returns it, after sleeping until it if need be. A
    sleep costs about a millisecond whatever its length, so sleeping per
    message would cap the rate near 1000/s: sleep only when ``PACE_SLACK``
    ahead. A sleep also ends up to a millisecond or so late: a limiter that
    restarted its schedule from the late wake-up would lose that much every
    time (at 10,000/s, a quarter of the rate), so up to ``PACE_CATCH_UP``
    behind the schedule is made up. Idle time beyond that earns no burst.

    Args:
      previous: the previous operation's slot (trio time), or its start.
      interval: seconds between two operations (1 / the rate).
    """
    now = trio.current_time()
    slot = previous + interval
    if slot < now - PACE_CATCH_UP:
        slot = now
    if slot - now > PACE_SLACK:
        await trio.sleep_until(slot)
    return slot
