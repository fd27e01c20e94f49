"""Poisson arrivals from a seeded generator, and the closed-loop budget."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from tokenyard.bench.arrivals import closed_loop_budget, poisson_intervals, poisson_offsets

N = 20_000


def _sample(rate: float, seed: int, n: int = N) -> list[float]:
    return list(itertools.islice(poisson_intervals(rate, random.Random(seed)), n))


@pytest.mark.parametrize("rate", [0.5, 4.0, 250.0])
def test_mean_interval_is_one_over_rate(rate: float) -> None:
    gaps = _sample(rate, seed=11)
    # the standard error of the mean is (1/rate)/sqrt(N) ≈ 0.7%; allow 3%
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)


def test_intervals_are_exponential() -> None:
    rate = 3.0
    gaps = sorted(_sample(rate, seed=5))
    assert min(gaps) >= 0
    # coefficient of variation of an exponential distribution is 1
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.03)
    # Kolmogorov-Smirnov distance to the exponential CDF, below the 1% critical value
    n = len(gaps)
    distance = max(
        max(abs((i + 1) / n - cdf), abs(i / n - cdf))
        for i, cdf in enumerate(1 - math.exp(-rate * x) for x in gaps)
    )
    assert distance < 1.63 / math.sqrt(n)
    # memorylessness, roughly: P(X > 2/rate) ≈ e^-2
    tail = sum(g > 2 / rate for g in gaps) / n
    assert tail == pytest.approx(math.exp(-2), abs=0.01)


def test_same_seed_same_arrivals_and_different_seed_different() -> None:
    assert _sample(2.0, seed=42, n=500) == _sample(2.0, seed=42, n=500)
    assert _sample(2.0, seed=42, n=500) != _sample(2.0, seed=43, n=500)
    first = list(poisson_offsets(5.0, random.Random("x"), count=50))
    assert first == list(poisson_offsets(5.0, random.Random("x"), count=50))


def test_offsets_by_count() -> None:
    offsets = list(poisson_offsets(10.0, random.Random(0), count=100))
    assert len(offsets) == 100
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert list(poisson_offsets(10.0, random.Random(0), count=0)) == []


def test_offsets_by_duration() -> None:
    rate, duration = 50.0, 40.0
    offsets = list(poisson_offsets(rate, random.Random(3), duration_s=duration))
    assert all(0 <= t < duration for t in offsets)
    # a Poisson count has standard deviation sqrt(2000) ≈ 45
    assert abs(len(offsets) - rate * duration) < 5 * math.sqrt(rate * duration)


def test_offsets_stop_at_whichever_limit_comes_first() -> None:
    assert len(list(poisson_offsets(100.0, random.Random(0), count=5, duration_s=100))) == 5
    short = list(poisson_offsets(1.0, random.Random(0), count=1000, duration_s=3))
    assert 1 <= len(short) < 20 and all(t < 3 for t in short)


def test_infinite_rate_is_a_burst() -> None:
    assert list(poisson_offsets(math.inf, random.Random(0), count=4)) == [0.0] * 4
    with pytest.raises(ValueError, match="count"):
        list(poisson_offsets(math.inf, random.Random(0), duration_s=1))


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_bad_rates(rate: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        next(poisson_intervals(rate, random.Random(0)))


def test_closed_loop_budget_by_count() -> None:
    budget = closed_loop_budget(0.0, count=3)
    assert [budget.take(now) for now in range(5)] == [True, True, True, False, False]


def test_closed_loop_budget_by_deadline() -> None:
    budget = closed_loop_budget(100.0, duration_s=2.0)
    assert budget.take(100.0) and budget.take(101.9)
    assert not budget.take(102.0)
    both = closed_loop_budget(0.0, count=10, duration_s=1.0)
    assert both.take(0.5) and not both.take(1.5)
    assert both.remaining == 9  # a refused ticket is not spent
    with pytest.raises(ValueError):
        closed_loop_budget(0.0)
