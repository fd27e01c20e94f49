"""Refuse at submit what the queue cannot serve in time: a deadline the estimated wait misses,
or, for an interactive call, a wait past the SLO (`queue_slo_s`). The estimate is
`tokenyard/gateway/admission_wait.py`; this is its I/O edge: each model's backlog and workers
are read at most every `ttl_s`, one read shared by every request of this gateway, never one
per request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from tokenyard.broker.core import LaneBacklog, Stats
from tokenyard.broker.tables import WorkerRegistry
from tokenyard.gateway.admission_wait import (
    Refusal,
    ServiceRate,
    Shortfall,
    queue_wait,
    refusal,
    with_admitted,
)
from tokenyard.gateway.errors import RateLimited
from tokenyard.messages import JobSpec

if TYPE_CHECKING:  # the state holds a QueueWaits
    from tokenyard.gateway.state import GatewayState


log = logging.getLogger(__name__)

# how many read periods old a snapshot may be and still answer while the next read runs
_STALE_TTLS = 2
# admitted live calls whose estimate waits for their outcome (older ones are forgotten)
_FOLLOWED = 10_000


class Snapshot(msgspec.Struct):
    """What one read saw of a model: its lanes, its live slots, its measured completion rate."""

    lanes: list[LaneBacklog]
    slots: int
    rate: float | None


@dataclass(eq=False)
class QueueWaits:
    """Each model's snapshot, read at most every `ttl_s` (one read however many requests)."""

    stats: Stats
    registry: WorkerRegistry
    ttl_s: float = 0.25
    halflife_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    shortfall: Shortfall = field(default_factory=Shortfall)
    _estimates: dict[str, float] = field(default_factory=dict, init=False)
    _known: dict[str, tuple[float, Snapshot]] = field(default_factory=dict, init=False)
    _rates: dict[str, ServiceRate] = field(default_factory=dict, init=False)
    _reading: dict[str, asyncio.Future[Snapshot]] = field(default_factory=dict, init=False)

    async def of(self, model: str) -> Snapshot:
        """The model's snapshot. A stale one (up to `_STALE_TTLS` reads old) is answered at once
        while a read refreshes it in the background, so no request waits on a read then."""
        known = self._known.get(model)
        age = None if known is None else self.clock() - known[0]
        if known is not None and age is not None and age < self.ttl_s:
            return known[1]
        reading = self._reading.get(model)
        if reading is None:
            reading = asyncio.ensure_future(self._read(model))
            self._reading[model] = reading
            reading.add_done_callback(lambda done: self._read_done(model, done))
        if known is not None and age is not None and age < _STALE_TTLS * self.ttl_s:
            return known[1]
        return await asyncio.shield(reading)

    def _read_done(self, model: str, done: asyncio.Future[Snapshot]) -> None:
        self._reading.pop(model, None)
        if not done.cancelled() and done.exception() is not None:
            # a failed background read keeps the last snapshot until it is too old to use
            log.debug("queue wait read for %s failed: %s", model, done.exception())

    async def wait(self, spec: JobSpec) -> float | None:
        """Estimated seconds before `spec` would start; None before a rate is measured."""
        snap = await self.of(spec.model)
        return queue_wait(
            snap.lanes, spec.tenant, spec.weight, spec.priority, slots=snap.slots, rate=snap.rate
        )

    def admitted(self, spec: JobSpec, followed: float | None = None) -> None:
        """Count a job admitted here since the last read (see `with_admitted`); `followed`:
        its estimated wait, for a live call whose outcome `observed` will report."""
        known = self._known.get(spec.model)
        if known is not None:
            snap = known[1]
            snap.lanes = with_admitted(snap.lanes, spec.tenant, spec.weight, spec.priority)
        if followed is not None:
            if len(self._estimates) >= _FOLLOWED:
                del self._estimates[next(iter(self._estimates))]
            self._estimates[spec.id] = followed

    def observed(self, job_id: str, queued_s: float | None) -> None:
        """A live call's job started after `queued_s` in the queue (None: unknown)."""
        estimated = self._estimates.pop(job_id, None)
        if estimated is not None and queued_s is not None:
            self.shortfall.observe(estimated, queued_s)

    async def _read(self, model: str) -> Snapshot:
        lanes, workers = await asyncio.gather(
            self.stats.backlog(model), self.registry.workers(model)
        )
        rate = self._rates.setdefault(model, ServiceRate(self.halflife_s))
        # jobs waiting for the workers: they run flat out, their completion rate is capacity
        rate.observe(workers, saturated=any(lane.queued or lane.tenants for lane in lanes))
        snap = Snapshot(lanes, rate.slots, rate.rate)
        self._known[model] = (self.clock(), snap)
        return snap


_REASONS = {
    "deadline": ("deadline_unmeetable", "its deadline is {left:.1f} s away"),
    "overloaded": ("queue_wait_exceeded", "this server admits up to {slo:g} s of queue wait"),
}


async def check(state: GatewayState, spec: JobSpec, *, own_deadline: bool, live: bool) -> None:
    """Refuse `spec` (429) when its estimated wait (scaled by how far recent estimates fell
    short, see `Shortfall`) misses its own deadline or, for a live call with the SLO on, exceeds
    the queue-wait SLO (or the call's request timeout, if shorter).
    A job read later is held only to its own deadline: it queues up to the lane bound. Only
    requests held to something cost a (shared) read."""
    now = time.time()
    slo: float | None = (state.settings.queue_slo_s or None) if live else None
    deadline = spec.deadline if own_deadline else None
    if slo is not None and not own_deadline and spec.deadline is not None:
        slo = min(slo, spec.deadline - now)  # the live call's timeout
    if deadline is None and slo is None:
        return  # nothing to hold it to: no read
    wait = await state.waits.wait(spec)
    refused = refusal(state.waits.shortfall.scaled(wait), now=now, deadline=deadline, slo_s=slo)
    if refused is None:
        state.waits.admitted(spec, wait if live else None)
        return
    state.metrics.rejections.labels(f"wait_{refused.reason}").inc()
    raise _error(refused, spec, now, slo)


def _error(refused: Refusal, spec: JobSpec, now: float, slo: float | None) -> RateLimited:
    code, why = _REASONS[refused.reason]
    left = (spec.deadline or now) - now
    message = (
        f"The estimated queue wait for model '{spec.model}' is {refused.wait_s:.1f} s and "
        + why.format(left=left, slo=slo or 0.0)
        + ("; retry later" if refused.retry_after_s is not None else "")
    )
    headers = {}
    if refused.retry_after_s is not None:
        headers["Retry-After"] = str(refused.retry_after_s)
    return RateLimited(message, code=code, headers=headers)
