"""Percentiles and latency summaries: pure functions over plain numbers."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation, as numpy's default method."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0 or math.isnan(q):
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    fraction = position - lower
    # numpy's form: exact at the ends and monotone in q even with huge magnitudes
    return ordered[lower] + (ordered[upper] - ordered[lower]) * fraction


@dataclass(frozen=True)
class Summary:
    """Count, mean, extremes and chosen percentiles of one metric."""

    count: int
    mean: float | None
    min: float | None
    max: float | None
    percentiles: dict[float, float | None]

    def as_dict(self, scale: float = 1.0, digits: int = 3) -> dict[str, float | int | None]:
        """JSON-ready fields (`p50`, `p90`, ...), values multiplied by `scale` (e.g. s → ms)."""

        def fmt(value: float | None) -> float | None:
            return None if value is None else round(value * scale, digits)

        out: dict[str, float | int | None] = {
            "count": self.count,
            "mean": fmt(self.mean),
            "min": fmt(self.min),
            "max": fmt(self.max),
        }
        for q, value in self.percentiles.items():
            out[percentile_key(q)] = fmt(value)
        return out


def percentile_key(q: float) -> str:
    """`p50`, `p99`, `p99.9`: the JSON key of a percentile."""
    return f"p{q:g}"


def summarize(
    values: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> Summary:
    """Summary of `values`; NaNs are dropped and an empty input gives `None` statistics."""
    percentiles = tuple(percentiles)
    clean = sorted(v for v in values if not math.isnan(v))
    if not clean:
        return Summary(0, None, None, None, dict.fromkeys(percentiles))
    return Summary(
        count=len(clean),
        mean=math.fsum(clean) / len(clean),
        min=clean[0],
        max=clean[-1],
        percentiles={q: percentile(clean, q) for q in percentiles},
    )


def rate(count: float, seconds: float) -> float:
    """Events per second; zero over a zero-length window instead of dividing by zero."""
    return count / seconds if seconds > 0 else 0.0


def intervals(times: Sequence[float]) -> list[float]:
    """Gaps between consecutive timestamps."""
    return [later - earlier for earlier, later in itertools.pairwise(times)]
