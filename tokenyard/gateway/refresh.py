"""Broker reads the gateway caches per key (API keys, tenants, whether auth is on, published
limits), refreshed ahead of their expiry so that no request waits on one while traffic flows.

A value is answered for `ttl_s` after its read began, never longer (the bound the settings
document, e.g. "a revoked key dies within `auth_cache_s`"). Once it is half that old, the
first request to see it starts one read in the background and is answered from the cache;
only a value past `ttl_s` (a key seen for the first time, or after a quiet spell) makes a
request wait, and then every request of that key shares one read.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from functools import partial
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RefreshAhead(Generic[K, V]):
    """`fetch(key)` cached `ttl_s` and refreshed from `ttl_s / 2` on; with `keep_on`, a read
    failing with one of those errors answers the last value however old (the broker is down:
    keep serving what was known) and raises only when there is none."""

    def __init__(
        self,
        fetch: Callable[[K], Awaitable[V]],
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        keep_on: tuple[type[BaseException], ...] = (),
        max_entries: int = 10_000,
    ) -> None:
        self.fetch = fetch
        self.ttl_s = ttl_s
        self.clock = clock
        self.keep_on = keep_on
        self.max_entries = max_entries  # distinct keys remembered; past it the cache starts over
        self._known: dict[K, tuple[float, V]] = {}
        self._reading: dict[K, asyncio.Future[V]] = {}

    async def get(self, key: K) -> V:
        known = self._known.get(key)
        if known is not None:
            age = self.clock() - known[0]
            if age < self.ttl_s:
                if age >= self.ttl_s / 2:
                    self._read(key)  # in the background: this request does not wait for it
                return known[1]
        try:
            return await asyncio.shield(self._read(key))
        except self.keep_on:
            if known is None:
                raise
            return known[1]

    def _read(self, key: K) -> asyncio.Future[V]:
        reading = self._reading.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self._fetch(key))
            self._reading[key] = reading
            reading.add_done_callback(partial(self._read_done, key))
        return reading

    async def _fetch(self, key: K) -> V:
        began = self.clock()  # a value's age counts from before the read: a bound, not a guess
        value = await self.fetch(key)
        if len(self._known) >= self.max_entries and key not in self._known:
            self._known.clear()
        self._known[key] = (began, value)
        return value

    def _read_done(self, key: K, done: asyncio.Future[V]) -> None:
        self._reading.pop(key, None)
        if not done.cancelled() and done.exception() is not None:
            # retrieved here: a background read nobody awaits fails quietly, the value stands
            log.debug("a cached broker read failed: %s", done.exception())
