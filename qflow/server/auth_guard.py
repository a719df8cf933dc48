"""Failed authentication, per peer address: qflowd's guard against password
guessing.

Each failed attempt (PLAIN, SCRAM-SHA-256, EXTERNAL) counts against the
client's IP address. While an address has recent failures, every new
connection from it waits its turn before its open is read: the turns are
``base`` x 2^(failures - 1) seconds apart, at most ``most``, so an address
that keeps failing gets about one attempt per ``most`` seconds, however many
connections it opens at once. The failures of an address are forgotten
``forget_after`` seconds after its last one. Its log lines are throttled too:
at most one WARNING per address per LOG_INTERVAL, with the count of those not
logged. PLAIN's password check (PBKDF2, milliseconds of CPU) runs in a worker
thread, at most ``threads`` at once, so that guesses cannot stall the event
loop that serves every other client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from qflow.protocol import sasl
from qflow.protocol.names import printable
from qflow.server.admission import Throttle

TRACKED = 10_000  # addresses remembered at most; past it the oldest are forgotten


class AuthGuard:
    """Failed attempts per address, their turns, and the hashing off the loop."""

    def __init__(self, base: float = 0.05, most: float = 2.0, forget_after: float = 60.0, threads: int = 1,
                 throttle: Throttle | None = None, clock: Callable[[], float] = trio.current_time) -> None:
        self.base = base
        self.most = most
        self.forget_after = forget_after
        self.clock = clock
        self.throttle = throttle or Throttle()
        self.failed_total = 0
        self._failures: dict[str, tuple[int, float]] = {}  # ip -> (failures, when the last was)
        self._next_turn: dict[str, float] = {}
        self._limiter: trio.CapacityLimiter | None = None
        self._threads = threads

    def _recent(self, ip: str) -> int:
        entry = self._failures.get(ip)
        if entry is None:
            return 0
        if self.clock() - entry[1] > self.forget_after:
            del self._failures[ip]
            self._next_turn.pop(ip, None)
            return 0
        return entry[0]

    async def wait_turn(self, ip: str) -> None:
        """Wait until a new attempt from ``ip`` may be read (at once, unless it failed recently)."""
        failures = self._recent(ip)
        if not failures:
            return
        gap = min(self.most, self.base * 2 ** min(failures - 1, 30))
        now = self.clock()
        turn = max(now, self._next_turn.get(ip, now))
        self._next_turn[ip] = turn + gap
        if turn > now:
            await trio.sleep_until(turn)

    def failed(self, ip: str, peer: str, user: str, detail: str) -> None:
        """An attempt from ``ip`` (``peer``: its address and port) failed: count it, and log it (throttled)."""
        self.failed_total += 1
        failures = self._recent(ip) + 1
        self._failures.pop(ip, None)  # re-inserted last: the dict stays oldest first
        self._failures[ip] = (failures, self.clock())
        while len(self._failures) > TRACKED:
            oldest = next(iter(self._failures))
            del self._failures[oldest]
            self._next_turn.pop(oldest, None)
        self.throttle.log(logging.WARNING, f"auth-failed {ip}",
                          "connection %s: authentication failed for user '%s' (%s)", peer, printable(user), detail)

    async def check_password(self, check: sasl.Verifier, password: str) -> bool:
        """Whether ``password`` matches ``check``, computed in a worker thread."""
        if self._limiter is None:
            self._limiter = trio.CapacityLimiter(self._threads)
        return await trio.to_thread.run_sync(sasl.check_password, check, password, limiter=self._limiter)
