"""The slow consumer of ``bench/compare``'s flow workload (its pacing is in
``bench/compare/clients.py``) keeps to a quarter of its own speed whatever its
client's sleep overshoots: the comparison with RabbitMQ is only fair if a trio
or asyncio consumer (whose timers wake on a whole millisecond) rests as long as
a ``time.sleep`` one, no longer."""

from __future__ import annotations

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_compare_clients",
                                               os.path.join(HERE, "..", "bench", "compare", "clients.py"))
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _run(monkeypatch: pytest.MonkeyPatch, messages: int, work: float, sleep: object) -> tuple[float, float]:
    """A consumer taking ``messages``, each ``work`` seconds of work, resting
    as ``sleep(d)`` says it really sleeps: (seconds working, seconds resting)."""
    clock = FakeClock()
    monkeypatch.setattr(compare.time, "monotonic", clock.monotonic)
    cons = compare.Cons({"ack_every": 500, "pause_every": 100, "slow_factor": 3.0, "count": messages})
    worked = rested = 0.0
    for _ in range(messages):
        d = cons.delay()
        if d > 0:
            slept = sleep(d)
            assert slept >= d
            clock.now += slept
            rested += slept
            cons.awake()
        clock.now += work
        worked += work
        cons.got(b"x" * 8)
    return worked, rested


@pytest.mark.parametrize("name,sleep", [
    ("exact", lambda d: d),
    ("time.sleep, 0.06 ms late", lambda d: d + 0.00006),
    ("an event loop's 1 ms tick", lambda d: (int(d * 1000) + 1) / 1000 + 0.0002),
])
def test_slow_consumer_rests_three_times_its_work(monkeypatch: pytest.MonkeyPatch, name: str, sleep: object) -> None:
    # 3 us of work per message: 100 messages take 0.3 ms, so each rest is due
    # 0.9 ms, less than the tick an event loop's sleep rounds up to.
    worked, rested = _run(monkeypatch, 100_000, 3e-6, sleep)
    assert rested / worked == pytest.approx(3.0, rel=0.02), name


def test_rest_time_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(compare.time, "monotonic", clock.monotonic)
    cons = compare.Cons({"ack_every": 500, "pause_every": 2, "slow_factor": 3.0})
    rests = []
    for _ in range(7):
        d = cons.delay()
        if d > 0:
            rests.append(d)
            clock.now += d + 0.001  # every rest 1 ms late
            cons.awake()
        clock.now += 0.01
        cons.got(b"12345678")
    # Messages 1-2 take 20 ms: rest 60 ms (61 taken). Messages 3-4: 20 ms of
    # work, 1 ms owed: rest 59 (60 taken). Messages 5-6: the same.
    assert rests == pytest.approx([0.06, 0.059, 0.059])
    assert cons.rested == pytest.approx(0.061 + 0.060 + 0.060)
