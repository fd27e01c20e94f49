"""The dashboard's charts: what each gateway records every few seconds (a `Point`, kept in the
broker's series table by gateway/recorder.py) and the chart values made of every gateway's
points (`chart`, pure).

A point holds gauges as the gateway saw the fleet (lane depths, workers) and the gateway's own
cumulative counters (answers by status, latency histograms, per-tenant use). Rates and
percentiles come from counters over a window, each gateway's from its own points and then
summed, so several gateways recording the same fleet count nothing twice; a gauge is the
newest look any gateway took. Rates over a window because heartbeats land every 2 s: two
looks a second apart saw 0 or 2 jobs of a 1 job/s fleet.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
from prometheus_client.metrics import MetricWrapperBase

from tokenyard.broker.core import BrokerStats
from tokenyard.messages import WorkerInfo

WINDOW_S = 20.0  # rates and percentiles at a point cover at least the 20 s before it
KEPT_S = 3600.0  # what the page shows: the last hour (the series table keeps a little more)


class Beat(NamedTuple):
    """A worker's cumulative count of finished jobs at its heartbeat's own time."""

    at: float
    done: int


def completed_per_s(samples: Sequence[Mapping[str, Beat]]) -> float | None:
    """Fleet completions per second over `samples` (oldest first; worker -> its beat): each
    worker of the newest sample counts from its first beat in them to its last, by the
    heartbeats' own clocks. None until some worker has beaten twice."""
    if not samples:
        return None
    total, measured = 0.0, False
    for worker, last in samples[-1].items():
        first = next(s[worker] for s in samples if worker in s)
        if last.at > first.at:
            total += max(0, last.done - first.done) / (last.at - first.at)
            measured = True
    return total if measured else None


def quantile(
    q: float, bounds: Sequence[float], older: Sequence[float], newer: Sequence[float]
) -> float | None:
    """The q-quantile of what a histogram observed between two reads of its cumulative
    bucket counts (`bounds` the finite upper bounds; the counts have one more, +Inf), linear
    within a bucket as Prometheus's histogram_quantile; None when nothing was observed."""
    counts = [max(0.0, n - o) for n, o in zip(newer, older, strict=True)]
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    i = bisect.bisect_left(counts, rank)
    if i >= len(bounds):  # in the +Inf bucket: the largest finite bound is all that is known
        return bounds[-1]
    lower = bounds[i - 1] if i > 0 else 0.0
    below = counts[i - 1] if i > 0 else 0.0
    inside = counts[i] - below
    if inside <= 0:
        return bounds[i]
    return lower + (bounds[i] - lower) * (rank - below) / inside


def histogram_counts(
    histogram: MetricWrapperBase, model: str, bounds: Sequence[float]
) -> list[float]:
    """A labelled histogram's cumulative counts for `model` at `bounds` then +Inf, as its
    collector reports them (zeros before its first observation)."""
    seen: dict[float, float] = {}
    for metric in histogram.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket") and s.labels.get("model") == model:
                seen[float(s.labels["le"])] = s.value
    return [seen.get(b, 0.0) for b in (*bounds, math.inf)]


# -- what a gateway records ------------------------------------------------------------------


class ModelPoint(msgspec.Struct, kw_only=True):
    """One look at a model: its lanes and workers (gauges), this gateway's latency counts."""

    waiting: dict[str, int]  # by lane (priority name)
    in_flight: int
    workers: int
    beats: dict[str, Beat]  # by worker
    tokens_per_s: float  # the workers' own moving averages, summed
    batch: float | None  # the workers' mean batch sizes, averaged over the busy ones
    ttft: list[float]  # cumulative bucket counts
    e2e: list[float]


class TenantPoint(msgspec.Struct, array_like=True):
    """A tenant's use through this gateway so far (cumulative), and its budget left."""

    requests: int  # jobs asked for (refused ones too)
    refused: int  # of which refused with 429 (its quota, a full lane, the queue's wait)
    tokens: int  # prompt + generated tokens of the calls this gateway answered live
    budget_left: int | None  # fleet-wide, from the quota table; None: no budget


class Point(msgspec.Struct, kw_only=True):
    """One gateway's record at `t` (its clock)."""

    t: float
    answers: dict[str, int]  # its API answers so far by class: 2xx, 4xx (but 429), 429, 5xx
    models: dict[str, ModelPoint]
    tenants: dict[str, TenantPoint]


ANSWER_CLASSES = ("2xx", "4xx", "429", "5xx")


def answer_class(status: int) -> str:
    """The class a status is counted under: 429 apart from the other 4xx; 1xx/3xx as 2xx."""
    if status == 429:
        return "429"
    if status >= 500:
        return "5xx"
    if status >= 400:
        return "4xx"
    return "2xx"


def model_point(
    stats: BrokerStats, workers: Iterable[WorkerInfo], ttft: Sequence[float], e2e: Sequence[float]
) -> ModelPoint:
    live = list(workers)
    busy = [w.mean_batch for w in live if w.mean_batch > 0]
    return ModelPoint(
        waiting={lane.priority.name.lower(): lane.waiting for lane in stats.lanes},
        in_flight=sum(lane.in_flight for lane in stats.lanes),
        workers=len(live),
        beats={w.consumer: Beat(w.at, w.jobs_done) for w in live},
        tokens_per_s=sum(w.tokens_per_s for w in live),
        batch=sum(busy) / len(busy) if busy else None,
        ttft=list(ttft),
        e2e=list(e2e),
    )


# -- the chart values of every gateway's points ----------------------------------------------


Recorded = tuple[str, Point]  # (the gateway that recorded it, the point)


def _rate(window: Sequence[Recorded], count: Callable[[Point], float | None]) -> float | None:
    """Per second over `window` (oldest first): each gateway's counter from its first point
    to its last there, summed over gateways; None until some gateway has two points with it.
    A counter a point lacks (a tenant not seen yet) counts 0 once a later point has it."""
    ends: dict[str, tuple[Point, Point]] = {}
    for source, p in window:
        first = ends.get(source, (p, p))[0]
        ends[source] = (first, p)
    total, measured = 0.0, False
    for first, last in ends.values():
        newer = count(last)
        if newer is None or last.t <= first.t:
            continue
        total += max(0.0, newer - (count(first) or 0.0)) / (last.t - first.t)
        measured = True
    return total if measured else None


def _summed_delta(
    window: Sequence[Recorded], counts: Callable[[Point], list[float] | None]
) -> list[float] | None:
    """Each gateway's histogram counts from its first point to its last in `window`, summed."""
    ends: dict[str, tuple[list[float], list[float]]] = {}
    for source, p in window:
        c = counts(p)
        if c is not None:
            ends[source] = (ends.get(source, (c, c))[0], c)
    if not ends:
        return None
    total: list[float] | None = None
    for older, newer in ends.values():
        delta = [max(0.0, n - o) for n, o in zip(newer, older, strict=True)]
        total = delta if total is None else [a + b for a, b in zip(total, delta, strict=True)]
    return total


def chart(
    recorded: Iterable[Recorded],
    after: float,
    step_s: float,
    ttft_bounds: Sequence[float],
    e2e_bounds: Sequence[float],
) -> dict[str, Any]:
    """The chart points after `after`: one per `step_s` in which any gateway recorded, at the
    newest point in it, each over the window before it (`recorded` must reach that far back).
    {"answers": [...], "models": {model: [...]}, "tenants": {tenant: [...]}}, oldest first."""
    ordered = sorted(recorded, key=lambda r: r[1].t)
    times = [p.t for _, p in ordered]
    window_s = max(WINDOW_S, 3 * step_s)
    out: dict[str, Any] = {"answers": [], "models": {}, "tenants": {}}
    models = sorted({m for _, p in ordered for m in p.models})
    tenants = sorted({t for _, p in ordered for t in p.tenants})
    for i, (_, point) in enumerate(ordered):
        last_of_step = i + 1 == len(ordered) or (
            math.floor(times[i + 1] / step_s) != math.floor(point.t / step_s)
        )
        if point.t <= after or not last_of_step:
            continue
        t = point.t
        window = ordered[bisect.bisect_right(times, t - window_s) : i + 1]
        out["answers"].append({"t": t, **{c: _rate(window, _answers(c)) for c in ANSWER_CLASSES}})
        for model in models:
            seen = _model_values(window, model, ttft_bounds, e2e_bounds)
            if seen is not None:
                out["models"].setdefault(model, []).append({"t": t, **seen})
        for tenant in tenants:
            use = _tenant_values(window, tenant)
            if use is not None:
                out["tenants"].setdefault(tenant, []).append({"t": t, **use})
    return out


def _answers(kind: str) -> Callable[[Point], float | None]:
    return lambda p: p.answers.get(kind, 0)


def _tenant_values(window: Sequence[Recorded], tenant: str) -> dict[str, Any] | None:
    looks = [(s, p) for s, p in window if tenant in p.tenants]
    if not looks:
        return None

    def use(field: str) -> Callable[[Point], float | None]:
        def count(p: Point) -> float | None:
            found = p.tenants.get(tenant)
            return None if found is None else float(getattr(found, field))

        return count

    return {
        "requests_per_s": _rate(window, use("requests")),
        "refused_per_s": _rate(window, use("refused")),
        "tokens_per_s": _rate(window, use("tokens")),
        "budget_left": looks[-1][1].tenants[tenant].budget_left,
    }


def _model_values(
    window: Sequence[Recorded],
    model: str,
    ttft_bounds: Sequence[float],
    e2e_bounds: Sequence[float],
) -> dict[str, Any] | None:
    looks = [(s, p) for s, p in window if model in p.models]
    if not looks:
        return None
    newest = looks[-1][1].models[model]
    ttft = _summed_delta(looks, lambda p: p.models[model].ttft)
    e2e = _summed_delta(looks, lambda p: p.models[model].e2e)
    # heartbeats carry the workers' own clocks: every gateway's looks are one sequence
    beats = [p.models[model].beats for _, p in looks]

    def q(p: float, bounds: Sequence[float], delta: list[float] | None) -> float | None:
        return None if delta is None else quantile(p, bounds, [0.0] * len(delta), delta)

    return {
        "waiting": dict(newest.waiting),
        "in_flight": newest.in_flight,
        "workers": newest.workers,
        "jobs_per_s": completed_per_s(beats),
        "tokens_per_s": newest.tokens_per_s,
        "batch": newest.batch,
        "ttft_p50": q(0.5, ttft_bounds, ttft),
        "ttft_p99": q(0.99, ttft_bounds, ttft),
        "e2e_p50": q(0.5, e2e_bounds, e2e),
        "e2e_p99": q(0.99, e2e_bounds, e2e),
    }
