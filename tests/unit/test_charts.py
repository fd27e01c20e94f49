"""The dashboard's chart values: rates from workers' counters over a window, percentiles from
histogram counts over a window, several gateways' points merged (tokenyard/gateway/charts.py)."""

from __future__ import annotations

import pytest

from tokenyard.broker.core import BrokerStats, LaneStats
from tokenyard.gateway.charts import (
    WINDOW_S,
    Beat,
    Point,
    Recorded,
    TenantPoint,
    answer_class,
    chart,
    completed_per_s,
    model_point,
    quantile,
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


def _point(t: float, i: int, counts: list[float], answers: dict[str, int]) -> Point:
    return Point(
        t=t,
        answers=answers,
        models={"m": model_point(_stats(waiting=i % 7), [_worker(t, i, 3.0)], counts, counts)},
        tenants={
            "acme": TenantPoint(requests=i, refused=i // 2, tokens=10 * i, budget_left=900 - i)
        },
    )


def test_an_hour_of_points_makes_a_chart_point_each_step_over_its_window() -> None:
    counts = [0.0] * (len(BOUNDS) + 1)
    recorded: list[Recorded] = []
    for i in range(0, 3600, 2):  # an hour, a point every 2 s, one job a second
        t = 1000.0 + i
        counts = [counts[0] + 2, counts[1] + 2, counts[2] + 2, counts[3] + 2]
        answers = {"2xx": 3 * i, "4xx": i // 2, "429": i, "5xx": 2 * i}
        recorded.append(("gw", _point(t, i, counts, answers)))
    drawn = chart(recorded, 0.0, 2.0, BOUNDS, BOUNDS)
    points = drawn["models"]["m"]
    assert len(points) == 1800 and points[0]["t"] == 1000.0 and points[-1]["t"] == 4598.0
    assert points[0]["jobs_per_s"] is None  # one look: no rate yet
    last = points[-1]
    assert last["waiting"] == {"high": 0, "normal": 3598 % 7} and last["in_flight"] == 2
    assert last["workers"] == 1
    assert last["jobs_per_s"] == pytest.approx(1.0)
    assert last["tokens_per_s"] == 40.0 and last["batch"] == 3.0
    assert last["ttft_p50"] == pytest.approx(0.05) and last["e2e_p99"] == pytest.approx(0.099)
    rates = drawn["answers"][-1]
    assert rates == {"t": 4598.0, "2xx": 3.0, "4xx": 0.5, "429": 1.0, "5xx": 2.0}
    acme = drawn["tenants"]["acme"][-1]
    assert acme == {
        "t": 4598.0,
        "requests_per_s": 1.0,
        "refused_per_s": 0.5,
        "tokens_per_s": 10.0,
        "budget_left": 900 - 3598,
    }
    # what came after a time, each point still over its whole window
    after = chart(recorded[-12:], 4594.0, 2.0, BOUNDS, BOUNDS)
    assert after["models"]["m"] == points[-2:]
    assert after["answers"] == drawn["answers"][-2:]


def test_gateways_rates_add_up_and_their_gauges_count_once() -> None:
    zero = [0.0] * (len(BOUNDS) + 1)
    recorded: list[Recorded] = []
    for i in range(11):  # two gateways, 5 s apart, out of phase; each answers 2/s
        for source, offset, rate in (("a", 0.0, 2), ("b", 1.0, 4)):
            t = 100.0 + 5 * i + offset
            p = _point(t, 7, zero, {"2xx": int(rate * 5 * i), "429": i})
            p.tenants = {"acme": TenantPoint(rate * 5 * i, 0, 0, None)}
            if source == "b" and i < 3:
                p.tenants = {}  # b saw acme only later
            recorded.append((source, p))
    drawn = chart(recorded, 0.0, 5.0, BOUNDS, BOUNDS)
    last = drawn["answers"][-1]
    assert last["t"] == 151.0  # the newest point of each step
    assert last["2xx"] == pytest.approx(6.0) and last["429"] == pytest.approx(0.4)
    assert drawn["models"]["m"][-1]["waiting"]["normal"] == 0  # 7 % 7: one look, not two
    assert drawn["models"]["m"][-1]["in_flight"] == 2
    assert drawn["tenants"]["acme"][-1]["requests_per_s"] == pytest.approx(6.0)
    assert drawn["tenants"]["acme"][-1]["budget_left"] is None
    assert [p["t"] for p in drawn["answers"]] == [101.0 + 5 * i for i in range(11)]


def test_an_answer_is_counted_by_its_class() -> None:
    assert [answer_class(s) for s in (200, 202, 304, 400, 404, 429, 500, 503)] == [
        "2xx", "2xx", "2xx", "4xx", "4xx", "429", "5xx", "5xx"
    ]  # fmt: skip
