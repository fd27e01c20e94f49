"""The dashboard's memory: every few seconds each gateway records a point of what it sees
(lanes, workers, its answers by status, its latency histograms, per-tenant use and budget
left) into the broker's series table, whether or not anyone watches. Every gateway's
dashboard reads every gateway's points (gateway/charts.py makes the chart values of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tokenyard.broker import Backend
from tokenyard.broker.core import Clock
from tokenyard.gateway.charts import (
    ANSWER_CLASSES,
    Point,
    TenantPoint,
    answer_class,
    histogram_counts,
    model_point,
)
from tokenyard.messages import encode
from tokenyard.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, GatewayMetrics
from tokenyard.tenancy.limiter import Quota, budget_left

log = logging.getLogger(__name__)

# the routes whose answers are the API's traffic: probes, scrapes and the dashboard's own
# polls are not
API_ROUTES = "/v1/"


@dataclass
class TenantUse:
    requests: int = 0
    refused: int = 0
    tokens: int = 0
    quota: Quota = field(default_factory=Quota)


@dataclass
class Usage:
    """This gateway's per-tenant counts, kept as it admits (gateway/submit.py)."""

    tenants: dict[str, TenantUse] = field(default_factory=dict)

    def _of(self, tenant: str) -> TenantUse:
        found = self.tenants.get(tenant)
        if found is None:
            found = self.tenants[tenant] = TenantUse()
        return found

    def asked(self, tenant: str, quota: Quota) -> None:
        use = self._of(tenant)
        use.requests += 1
        use.quota = quota  # as last seen: the directory may change it

    def refused(self, tenant: str) -> None:
        self._of(tenant).refused += 1

    def used(self, tenant: str, tokens: int) -> None:
        self._of(tenant).tokens += tokens


def answers(metrics: GatewayMetrics) -> dict[str, int]:
    """This gateway's API answers so far by class (charts.ANSWER_CLASSES)."""
    counts = dict.fromkeys(ANSWER_CLASSES, 0)
    for metric in metrics.requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels.get("route", "").startswith(API_ROUTES):
                counts[answer_class(int(s.labels["status"]))] += int(s.value)
    return counts


async def take(
    backend: Backend, metrics: GatewayMetrics, usage: Usage, models: Sequence[str], now: float
) -> Point:
    """What this gateway sees at `now`: the fleet's gauges, its own counters."""
    queue, registry = backend.queue, backend.registry

    async def one(model: str) -> tuple[str, object]:
        stats, workers = await asyncio.gather(queue.stats(model), registry.workers(model))
        ttft = histogram_counts(metrics.time_to_first_token, model, TTFT_BUCKETS)
        e2e = histogram_counts(metrics.e2e_request_latency, model, REQUEST_LATENCY_BUCKETS)
        return model, model_point(stats, workers, ttft, e2e)

    looks = await asyncio.gather(*(one(m) for m in models))
    budgeted = [name for name, use in usage.tenants.items() if use.quota.token_budget]
    states = await asyncio.gather(*(backend.quotas.usage(name) for name in budgeted))
    left = {
        name: budget_left(state, usage.tenants[name].quota, now)
        for name, state in zip(budgeted, states, strict=True)
    }
    return Point(
        t=now,
        answers=answers(metrics),
        models=dict(looks),  # type: ignore[arg-type]
        tenants={
            name: TenantPoint(use.requests, use.refused, use.tokens, left.get(name))
            for name, use in usage.tenants.items()
        },
    )


@dataclass(eq=False)
class Recorder:
    """Records a point every `interval_s` into `backend.series` under `source` (this
    gateway's id), from a task of its own; a broker that does not answer costs a point."""

    backend: Backend
    metrics: GatewayMetrics
    usage: Usage
    models: Callable[[], Sequence[str]]
    source: str
    interval_s: float
    clock: Clock = time.time
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    _task: asyncio.Task[None] | None = field(default=None, init=False)

    async def record(self) -> Point:
        """Take one point and append it."""
        point = await take(self.backend, self.metrics, self.usage, self.models(), self.clock())
        await self.backend.series.append(self.source, point.t, encode(point))
        return point

    async def run(self) -> None:
        while True:
            try:
                await self.record()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker away: the chart has a gap, nothing more
                log.warning("dashboard point not recorded: %s", exc)
            await self.sleep(self.interval_s)

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._task = asyncio.create_task(self.run(), name="tokenyard-recorder")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
