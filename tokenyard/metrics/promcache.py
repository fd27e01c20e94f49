"""Prometheus metrics whose `.labels(...)` children are remembered per label tuple.

prometheus_client's `labels()` converts every value with `str()`, checks the count and takes
the metric's lock on each call; the gateway makes ~9 such calls per request. These subclasses
answer a repeated call from a dict: same names, labels and exposition. Values are looked up by
equality, so callers pass plain strings (as they already do). `BulkHistogram.observe_many` is
`count` observations of one value in one step, `observe_all` many values in one step.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable
from typing import Any, Self

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase


class _LabelCache(MetricWrapperBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._children: dict[tuple[object, ...], Self] = {}
        super().__init__(*args, **kwargs)

    def labels(self, *labelvalues: object, **labelkwargs: object) -> Self:
        if labelkwargs:
            return super().labels(*labelvalues, **labelkwargs)
        child = self._children.get(labelvalues)
        if child is None:
            child = self._children[labelvalues] = super().labels(*labelvalues)
        return child

    def remove(self, *labelvalues: Any) -> None:
        self._children.clear()
        super().remove(*labelvalues)

    def clear(self) -> None:
        self._children.clear()
        super().clear()


class CachedCounter(_LabelCache, Counter):
    pass


class CachedGauge(_LabelCache, Gauge):
    pass


class BulkHistogram(Histogram):
    """A histogram that takes many observations of one value at once."""

    def observe_many(self, amount: float, count: int) -> None:
        """`count` observations of one value, as `observe` makes them, in one step: one engine
        step's tokens share one gap, and a sync call's 500 tokens would be 500 calls."""
        if count <= 0:
            return
        self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        self._sum.inc(amount * count)
        for bucket, bound in zip(self._buckets, self._upper_bounds, strict=True):
            if amount <= bound:
                bucket.inc(count)
                break

    def observe_all(self, amounts: Iterable[float]) -> None:
        """Each of `amounts` observed, as `observe` would, with one increment per bucket hit:
        the worker times every job of a claim or a step, and each `observe` takes two locks."""
        counts: dict[int, int] = {}
        bounds = self._upper_bounds
        total = 0.0
        for amount in amounts:
            total += amount
            at = bisect_left(bounds, amount)  # the first bound >= amount: `observe`'s bucket
            counts[at] = counts.get(at, 0) + 1
        if not counts:
            return
        self._raise_if_not_observable()  # type: ignore[no-untyped-call]
        self._sum.inc(total)
        for at, count in counts.items():
            self._buckets[at].inc(count)


class CachedHistogram(_LabelCache, BulkHistogram):
    pass
