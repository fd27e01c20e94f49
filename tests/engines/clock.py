"""A virtual clock for engine tests: sleeping only advances time, so tests are fast and exact."""

from __future__ import annotations

import threading
import time


class VirtualClock:
    """A clock whose sleep only advances time: fast, deterministic engine tests."""

    def __init__(self, start: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._now = start
        self.sleeps: list[float] = []

    def time(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            self.sleeps.append(seconds)
        time.sleep(0)  # let other threads run, as a real sleep would
