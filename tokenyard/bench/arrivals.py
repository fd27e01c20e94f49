"""When requests are sent: Poisson arrivals (open loop) and a shared budget for N clients."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass


def poisson_intervals(rate: float, rng: random.Random) -> Iterator[float]:
    """Endless exponential inter-arrival times (seconds) of a Poisson process at `rate`/s."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"arrival rate must be a positive finite number, got {rate}")
    while True:
        yield rng.expovariate(rate)


def poisson_offsets(
    rate: float,
    rng: random.Random,
    *,
    count: int | None = None,
    duration_s: float | None = None,
) -> Iterator[float]:
    """Send times (seconds from the start) until `count` arrivals or `duration_s`, if given.

    The first request goes at 0 so short runs spend no idle time; later ones follow
    exponential gaps. An infinite rate sends everything at 0 (a burst).
    """
    if count is not None and count < 0:
        raise ValueError("count must not be negative")
    if duration_s is not None and duration_s < 0:
        raise ValueError("duration must not be negative")
    if math.isinf(rate) and rate > 0:
        if count is None:
            raise ValueError("a burst (infinite rate) needs a request count")
        yield from (0.0 for _ in range(count))
        return
    gaps = poisson_intervals(rate, rng)
    offset, sent = 0.0, 0
    while (count is None or sent < count) and (duration_s is None or offset < duration_s):
        yield offset
        sent += 1
        offset += next(gaps)


@dataclass
class ClosedLoopBudget:
    """What N closed-loop clients share: how many requests remain and until when to start new ones.

    Each client takes a ticket before sending and sends nothing once `take` says no, so the
    number in flight never exceeds the number of clients.
    """

    remaining: int | None
    deadline: float | None

    def take(self, now: float) -> bool:
        """Whether a client may start another request at loop time `now`."""
        if self.deadline is not None and now >= self.deadline:
            return False
        if self.remaining is None:
            return True
        if self.remaining <= 0:
            return False
        self.remaining -= 1
        return True


def closed_loop_budget(
    start: float, *, count: int | None = None, duration_s: float | None = None
) -> ClosedLoopBudget:
    """A budget that ends after `count` requests or `duration_s` past `start`, whichever first."""
    if count is None and duration_s is None:
        raise ValueError("a closed loop needs a request count or a duration")
    deadline = None if duration_s is None else start + duration_s
    return ClosedLoopBudget(remaining=count, deadline=deadline)
