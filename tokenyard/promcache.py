"""Prometheus metrics whose `.labels(...)` children are remembered per label tuple.

prometheus_client's `labels()` converts every value with `str()`, checks the count and takes
the metric's lock on each call; the gateway makes ~9 such calls per request. These subclasses
answer a repeated call from a dict: same names, labels and exposition. Values are looked up by
equality, so callers pass plain strings (as they already do).
"""

from __future__ import annotations

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


class CachedHistogram(_LabelCache, Histogram):
    pass
