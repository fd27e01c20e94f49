"""Percentiles (numpy's linear method) and summaries, against known values and edge cases."""

from __future__ import annotations

import math
import random

import pytest

from tokenyard.bench.stats import intervals, percentile, percentile_key, rate, summarize


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1, 2, 3, 4], 50, 2.5),
        ([1, 2, 3, 4], 90, 3.7),
        ([1, 2, 3, 4], 99, 3.97),
        ([1, 2, 3, 4], 0, 1.0),
        ([1, 2, 3, 4], 100, 4.0),
        ([10, 20, 30, 40, 50], 50, 30.0),
        ([10, 20, 30, 40, 50], 25, 20.0),
        ([10, 20, 30, 40, 50], 10, 14.0),
        ([4, 1, 3, 2], 50, 2.5),  # order of the input does not matter
        ([7.5], 0, 7.5),
        ([7.5], 99, 7.5),
        ([2, 2, 2], 90, 2.0),
        ([0, 1], 50, 0.5),
        ([-3, 3], 75, 1.5),
    ],
)
def test_percentile_known_values(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected, abs=1e-12)


def test_percentile_matches_numpy_default_method() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    for n in (1, 2, 3, 10, 101, 1000):
        values = [rng.lognormvariate(0, 1) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(
                float(np.percentile(values, q)), rel=1e-12
            )


def test_percentile_is_monotone_in_q() -> None:
    values = [random.Random(1).random() for _ in range(50)]
    results = [percentile(values, q) for q in range(101)]
    assert results == sorted(results)


@pytest.mark.parametrize("q", [-0.1, 100.1, math.nan])
def test_percentile_rejects_q_out_of_range(q: float) -> None:
    with pytest.raises(ValueError, match="within"):
        percentile([1.0, 2.0], q)


def test_percentile_of_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_summarize() -> None:
    summary = summarize([0.4, 0.1, 0.3, 0.2])
    assert summary.count == 4
    assert summary.mean == pytest.approx(0.25)
    assert (summary.min, summary.max) == (0.1, 0.4)
    assert summary.percentiles[50] == pytest.approx(0.25)
    fields = summary.as_dict(scale=1000.0)
    assert fields == {
        "count": 4,
        "mean": 250.0,
        "min": 100.0,
        "max": 400.0,
        "p50": 250.0,
        "p90": 370.0,
        "p99": 397.0,
    }


def test_summarize_empty_and_nan() -> None:
    empty = summarize([]).as_dict()
    assert empty == {
        "count": 0,
        "mean": None,
        "min": None,
        "max": None,
        "p50": None,
        "p90": None,
        "p99": None,
    }
    assert summarize([math.nan, 1.0, math.nan]).count == 1
    assert summarize([math.nan]).count == 0


def test_summarize_accepts_a_generator_and_custom_percentiles() -> None:
    summary = summarize((x for x in range(101)), percentiles=(50, 99.9))
    assert summary.as_dict() == {
        "count": 101,
        "mean": 50.0,
        "min": 0.0,
        "max": 100.0,
        "p50": 50.0,
        "p99.9": 99.9,
    }


def test_helpers() -> None:
    assert percentile_key(50) == "p50" and percentile_key(99.9) == "p99.9"
    assert rate(10, 2.0) == 5.0 and rate(10, 0.0) == 0.0
    assert intervals([1.0, 1.5, 3.0]) == [0.5, 1.5]
    assert intervals([1.0]) == [] and intervals([]) == []
