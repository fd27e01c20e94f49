"""The dashboard's chart values: rates from workers' counters over a window, percentiles from
histogram counts over a window (tokenyard/gateway/charts.py)."""

from __future__ import annotations

import pytest

from tokenyard.broker.core import BrokerStats, LaneStats
from tokenyard.gateway.charts import (
    WINDOW_S,
    Beat,
    ModelChart,
    completed_per_s,
    quantile,
    sample,
)
from tokenyard.messages import Priority, WorkerInfo

BOUNDS = (0.1, 0.5, 1.0)


def polls(rate: float, heartbeat_s: float, poll_s: float, n: int) -> list[dict[str, Beat]]:
    """What polls every `poll_s` see of one worker finishing `rate` jobs/s and beating every
    `heartbeat_s`: its latest heartbeat's count, stamped with the heartbeat's time."""
    seen = []
    for i in range(n):
        t = i * poll_s
        beat_at = (t // heartbeat_s) * heartbeat_s
        seen.append({"w": Beat(beat_at, int(rate * beat_at))})
    return seen


def test_the_completion_rate_is_steady_when_polls_outpace_heartbeats() -> None:
    # polls every 1 s, heartbeats every 2 s: a poll-to-poll difference reads 0 then 2x the rate
    seen = polls(rate=5.0, heartbeat_s=2.0, poll_s=1.0, n=40)
    window = int(WINDOW_S)  # one poll a second
    rates = [completed_per_s(seen[i - window : i]) for i in range(window, len(seen))]
    assert rates == [pytest.approx(5.0)] * len(rates)


def test_the_completion_rate_sums_workers_and_ignores_those_that_left() -> None:
    samples = [
        {"a": Beat(0.0, 10), "gone": Beat(0.0, 100)},
        {"a": Beat(2.0, 14), "gone": Beat(2.0, 150), "new": Beat(2.0, 0)},
        {"a": Beat(4.0, 18), "new": Beat(4.0, 6)},
    ]
    # a: 8 jobs in 4 s; new: 6 in 2 s; the worker that left finishes nothing any more
    assert completed_per_s(samples) == pytest.approx(2.0 + 3.0)


def test_no_completion_rate_before_a_worker_beats_twice() -> None:
    assert completed_per_s([]) is None
    assert completed_per_s([{"a": Beat(1.0, 3)}, {"a": Beat(1.0, 3)}]) is None
    # a restarted worker's counter starts again: no negative rate
    assert completed_per_s([{"a": Beat(1.0, 9)}, {"a": Beat(3.0, 2)}]) == 0.0


def test_quantiles_come_from_the_window_s_bucket_differences() -> None:
    older = [5, 5, 5, 5]  # what came before the window does not count
    newer = [5 + 50, 5 + 90, 5 + 100, 5 + 100]  # 50 under 0.1 s, 40 in (0.1, 0.5], 10 in (0.5, 1]
    assert quantile(0.5, BOUNDS, older, newer) == pytest.approx(0.1)
    assert quantile(0.7, BOUNDS, older, newer) == pytest.approx(0.1 + 0.4 * 20 / 40)
    assert quantile(0.99, BOUNDS, older, newer) == pytest.approx(0.5 + 0.5 * 9 / 10)
    assert quantile(0.5, BOUNDS, newer, newer) is None  # nothing observed in the window
    # past the largest bound: that bound is all a histogram knows
    assert quantile(0.99, BOUNDS, [0, 0, 0, 0], [0, 0, 0, 10]) == 1.0


def _stats(waiting: int) -> BrokerStats:
    lanes = [
        LaneStats("m", Priority.HIGH, 0, 0, None),
        LaneStats("m", Priority.NORMAL, waiting, 2, 1.5),
    ]
    return BrokerStats("m", lanes, delayed=0, dead_letters=0, fenced_completions=0, expired=0)


def _worker(at: float, done: int, batch: float) -> WorkerInfo:
    return WorkerInfo(
        consumer="w",
        model="m",
        engine="sim",
        host="h",
        pid=1,
        started_at=0.0,
        tokens_per_s=40.0,
        mean_batch=batch,
        jobs_done=done,
        at=at,
    )


def test_a_chart_keeps_points_over_minutes_and_computes_each_over_its_window() -> None:
    chart = ModelChart()
    counts = [0.0] * (len(BOUNDS) + 1)
    for i in range(0, 1200, 2):  # 20 minutes, a point every 2 s, one job a second
        t = 1000.0 + i
        counts = [counts[0] + 2, counts[1] + 2, counts[2] + 2, counts[3] + 2]
        s = sample(t, _stats(waiting=i % 7), [_worker(t, i, 3.0)], counts, counts)
        chart.add(s, BOUNDS, BOUNDS)
    points = list(chart.points)
    assert points[-1]["t"] - points[0]["t"] <= 15 * 60  # the last 15 minutes kept
    last = points[-1]
    assert last["waiting"] == {"high": 0, "normal": 1198 % 7} and last["in_flight"] == 2
    assert last["jobs_per_s"] == pytest.approx(1.0)
    assert last["tokens_per_s"] == 40.0 and last["batch"] == 3.0
    assert last["ttft_p50"] == pytest.approx(0.05) and last["e2e_p99"] == pytest.approx(0.099)
    assert chart.since(last["t"] - 3) == points[-2:]
    assert not chart.due(last["t"] + 0.5) and chart.due(last["t"] + 1.0)
