"""The dashboard's charts: the fleet sampled while someone watches, as points over the last
minutes. Rates and percentiles come from cumulative counters over a window (pure functions):
two polls a second apart saw 0 or 2 jobs of a 1 job/s fleet, as heartbeats land every 2 s.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from prometheus_client.metrics import MetricWrapperBase

from tokenyard.broker.core import BrokerStats
from tokenyard.messages import WorkerInfo

WINDOW_S = 20.0  # rates and percentiles at a point cover the 20 s before it
KEPT_S = 15 * 60.0  # points kept (while nobody watches, none are taken: the chart has a gap)
MIN_STEP_S = 1.0  # a poll sooner than this after the last point reuses it (several tabs)


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


@dataclass(frozen=True)
class Sample:
    """One look at a model: its lanes, its workers' beats and this gateway's latency counts."""

    at: float
    waiting: Mapping[str, int]  # by lane (priority name)
    in_flight: int
    beats: Mapping[str, Beat]  # by worker
    tokens_per_s: float  # the workers' own moving averages, summed
    batch: float | None  # the workers' mean batch sizes, averaged over the busy ones
    ttft: Sequence[float]  # cumulative bucket counts
    e2e: Sequence[float]


def sample(
    at: float,
    stats: BrokerStats,
    workers: Iterable[WorkerInfo],
    ttft: Sequence[float],
    e2e: Sequence[float],
) -> Sample:
    live = list(workers)
    busy = [w.mean_batch for w in live if w.mean_batch > 0]
    return Sample(
        at=at,
        waiting={lane.priority.name.lower(): lane.waiting for lane in stats.lanes},
        in_flight=sum(lane.in_flight for lane in stats.lanes),
        beats={w.consumer: Beat(w.at, w.jobs_done) for w in live},
        tokens_per_s=sum(w.tokens_per_s for w in live),
        batch=sum(busy) / len(busy) if busy else None,
        ttft=tuple(ttft),
        e2e=tuple(e2e),
    )


def point(
    window: Sequence[Sample], ttft_bounds: Sequence[float], e2e_bounds: Sequence[float]
) -> dict[str, Any]:
    """The chart values at the newest sample of `window` (oldest first, spanning WINDOW_S)."""
    first, last = window[0], window[-1]

    def q(
        p: float, bounds: Sequence[float], older: Sequence[float], newer: Sequence[float]
    ) -> float | None:
        return quantile(p, bounds, older, newer) if len(window) > 1 else None

    return {
        "t": last.at,
        "waiting": dict(last.waiting),
        "in_flight": last.in_flight,
        "jobs_per_s": completed_per_s([s.beats for s in window]),
        "tokens_per_s": last.tokens_per_s,
        "batch": last.batch,
        "ttft_p50": q(0.5, ttft_bounds, first.ttft, last.ttft),
        "ttft_p99": q(0.99, ttft_bounds, first.ttft, last.ttft),
        "e2e_p50": q(0.5, e2e_bounds, first.e2e, last.e2e),
        "e2e_p99": q(0.99, e2e_bounds, first.e2e, last.e2e),
    }


@dataclass
class ModelChart:
    """A model's samples and the points made of them, over the last KEPT_S."""

    samples: deque[Sample] = field(default_factory=deque)
    points: deque[dict[str, Any]] = field(default_factory=deque)

    def add(self, s: Sample, ttft_bounds: Sequence[float], e2e_bounds: Sequence[float]) -> None:
        self.samples.append(s)
        while self.samples[0].at < s.at - WINDOW_S:
            self.samples.popleft()
        self.points.append(point(list(self.samples), ttft_bounds, e2e_bounds))
        while self.points[0]["t"] < s.at - KEPT_S:
            self.points.popleft()

    def due(self, now: float) -> bool:
        return not self.points or now - self.points[-1]["t"] >= MIN_STEP_S

    def since(self, t: float) -> list[dict[str, Any]]:
        """The points after `t`, oldest first."""
        return [p for p in self.points if p["t"] > t]


@dataclass
class Charts:
    """Every model's chart on this gateway."""

    models: dict[str, ModelChart] = field(default_factory=dict)

    def of(self, model: str) -> ModelChart:
        return self.models.setdefault(model, ModelChart())
