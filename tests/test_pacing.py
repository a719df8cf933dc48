"""The client's rate limiter (qflow.client.pacing) keeps its rate although
every sleep ends late, as trio's do (epoll's millisecond), and still earns no
burst from idle time. A fake clock: no timing in the test."""

from __future__ import annotations

import pytest

from qflow.client import pacing


class LateSleeper:
    """A clock whose sleeps end ``late`` seconds after their deadline."""

    def __init__(self, late: float) -> None:
        self.now = 1000.0
        self.late = late

    def current_time(self) -> float:
        return self.now

    async def sleep_until(self, deadline: float) -> None:
        self.now = max(self.now, deadline) + self.late


@pytest.mark.parametrize("late", [0.0, 0.0003, 0.0012])
async def test_rate_kept_though_every_sleep_ends_late(monkeypatch: pytest.MonkeyPatch, late: float) -> None:
    clock = LateSleeper(late)
    monkeypatch.setattr(pacing, "trio", clock)
    start = clock.now
    slot = 0.0
    for _ in range(10_000):  # 10,000 operations at 10,000/s: one second
        slot = await pacing.pace(slot, 1e-4)
    assert clock.now - start == pytest.approx(1.0, abs=0.01)


async def test_idle_time_earns_no_burst(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = LateSleeper(0.0)
    monkeypatch.setattr(pacing, "trio", clock)
    slot = await pacing.pace(0.0, 0.01)
    clock.now += 5.0  # idle: 500 slots unused
    first = await pacing.pace(slot, 0.01)
    assert first == clock.now  # not 499 operations at once
    slot = first
    for _ in range(10):
        slot = await pacing.pace(slot, 0.01)
    assert clock.now - first >= 0.08  # and the next ones at the rate
