"""A circuit breaker for a reward service: after a run of failures, stop sending for a while.

Closed, every request goes. `failures` failed requests in a row open it: none goes until
`cooldown_s` has passed; then one probe goes (half open) and decides: a success closes it, a
failure opens it again for twice as long (up to `MAX_DOUBLINGS` doublings), so a service that is
down is asked once a cooldown, not by every waiting reward at once. Pure: told the time.
"""

from __future__ import annotations

MAX_DOUBLINGS = 4


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float) -> None:
        if failures < 1 or not cooldown_s > 0:
            raise ValueError(f"failures >= 1 and cooldown_s > 0, got {failures}, {cooldown_s}")
        self.failures, self.cooldown_s = failures, cooldown_s
        self.in_a_row = 0
        self.opened = 0  # times it opened since it last closed
        self.open_until: float | None = None  # None: closed
        self.probing = False
        self.trips = 0  # times it opened, in all

    def wait_s(self, now: float) -> float:
        """0 when a request may go at `now` (a probe, when it is half open: the caller sends
        it); else how long to wait before asking again."""
        if self.open_until is None:
            return 0.0
        if now < self.open_until:
            return self.open_until - now
        if self.probing:
            return min(self.cooldown_s, 0.05)  # the probe's answer decides: ask again soon
        self.probing = True
        return 0.0

    def abandoned(self) -> None:
        """A request went without an answer either way (it was cancelled): were it the probe,
        the next caller probes instead."""
        self.probing = False

    def succeeded(self) -> None:
        self.in_a_row = self.opened = 0
        self.open_until, self.probing = None, False

    def failed(self, now: float) -> None:
        self.in_a_row += 1
        if self.probing or (self.open_until is None and self.in_a_row >= self.failures):
            self.open_until = now + self.cooldown_s * 2 ** min(self.opened, MAX_DOUBLINGS)
            self.opened += 1
            self.trips += 1
            self.probing = False
