"""Backoff, claim-order and liveness policy: pure functions with seeded randomness or
injected time."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenyard.broker.policy import (
    backoff_delay,
    beat_period,
    beating_since,
    claim_order,
    estimated_tokens,
    joinable,
    lapsed,
    may_reap,
    pools_served,
    size_pool,
)
from tokenyard.config import BrokerSettings, parse_pool_bounds
from tokenyard.errors import FatalError
from tokenyard.messages import JobSpec, JobStatus, SamplingParams


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    rng = random.Random(7)
    ceilings = [max(backoff_delay(a, 0.5, 10.0, rng) for _ in range(500)) for a in range(8)]
    assert 0.4 < ceilings[0] <= 0.5
    assert 0.9 < ceilings[1] <= 1.0
    assert 3.5 < ceilings[3] <= 4.0
    assert all(9.0 < c <= 10.0 for c in ceilings[5:])


def test_backoff_has_full_jitter() -> None:
    rng = random.Random(1)
    delays = [backoff_delay(4, 1.0, 100.0, rng) for _ in range(1000)]
    assert min(delays) < 1.0 and max(delays) > 15.0
    assert all(0.0 <= d <= 16.0 for d in delays)


def test_backoff_is_deterministic_with_a_seeded_rng() -> None:
    a = [backoff_delay(i, 0.1, 5.0, random.Random(3)) for i in range(5)]
    b = [backoff_delay(i, 0.1, 5.0, random.Random(3)) for i in range(5)]
    assert a == b


def test_claim_order_is_strict_priority_most_rounds() -> None:
    assert claim_order(3, 0, 8) == [0, 1, 2]
    assert claim_order(3, 6, 8) == [0, 1, 2]


def test_claim_order_gives_each_lower_lane_a_turn() -> None:
    heads = Counter(claim_order(3, r, 4)[0] for r in range(400))
    assert heads[0] == 300
    assert heads[1] == 50 and heads[2] == 50


def test_claim_order_without_anti_starvation() -> None:
    assert all(claim_order(3, r, 0) == [0, 1, 2] for r in range(20))
    assert claim_order(1, 7, 8) == [0]


def test_size_pools_by_estimated_tokens() -> None:
    bounds = parse_pool_bounds("2048, 8192")
    assert bounds == (2048, 8192) and parse_pool_bounds("") == ()
    assert [size_pool(n, bounds) for n in (1, 2048, 2049, 8192, 8193)] == [0, 0, 1, 1, 2]
    assert size_pool(10**6, ()) == 0
    # a worker claims the pools whose every job it holds, its own first
    assert pools_served(1024, bounds) == [0]  # holds no pool fully: the smallest still
    assert pools_served(4096, bounds) == [0]
    assert pools_served(8192, bounds) == [1, 0]
    assert pools_served(32768, bounds) == [2, 1, 0]
    assert pools_served(4096, ()) == [0]
    ids = JobSpec(
        id="x", model="m", prompt_token_ids=[1] * 100, sampling=SamplingParams(max_tokens=28)
    )
    assert estimated_tokens(ids) == 128
    text = JobSpec(id="x", model="m", prompt="abcdefgh", sampling=SamplingParams(max_tokens=10))
    assert estimated_tokens(text) == 13
    for bad in ("8192,2048", "0,10", "a,b", "5,5"):
        with pytest.raises(FatalError):
            parse_pool_bounds(bad)


def test_a_collapse_key_is_joined_in_flight_and_briefly_after_success_only() -> None:
    for status in (JobStatus.QUEUED, JobStatus.RUNNING):
        assert joinable(status, None, now=100.0, grace_s=5.0)
    # succeeded: its answer is in its record until the response cache has it
    assert joinable(JobStatus.SUCCEEDED, 96.0, now=100.0, grace_s=5.0)
    assert not joinable(JobStatus.SUCCEEDED, 95.0, now=100.0, grace_s=5.0)
    assert not joinable(JobStatus.SUCCEEDED, None, now=100.0, grace_s=5.0)
    for status in (JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED, JobStatus.DEAD):
        assert not joinable(status, 99.9, now=100.0, grace_s=5.0)


def _found_dead_at(beats: list[float], liveness_s: float, reaps: list[float]) -> float | None:
    """The first reap at which a worker beating at `beats` is found dead (as `beat` and
    `reap` decide it: each beat makes it live until liveness_s later)."""
    for now in reaps:
        live = {"w": max((t for t in beats if t <= now), default=-1e9) + liveness_s}
        if lapsed(live, now) == ["w"]:
            return now
    return None


def test_a_killed_worker_is_found_dead_within_three_seconds_by_default() -> None:
    liveness_s = BrokerSettings().liveness_s
    period = beat_period(liveness_s)
    ticks = [i * period for i in range(200)]
    for killed in (10.0, 10.0 + period / 3, 10.0 + period * 0.99):
        beats = [t for t in ticks if t < killed]
        # another worker reaps on its own ticks, out of step with the dead one's
        found = _found_dead_at(beats, liveness_s, [t + period / 7 for t in ticks])
        assert found is not None and found - killed <= liveness_s + period <= 3.0


def test_a_worker_paused_for_up_to_three_quarters_of_its_liveness_is_not_found_dead() -> None:
    liveness_s = BrokerSettings().liveness_s
    period = beat_period(liveness_s)
    reaps = [i * period / 10 for i in range(400)]
    for pause in (0.5, 1.0, 0.75 * liveness_s - 0.01):
        # beats every period, then none for `pause` past the next (an event loop stalled by a
        # GC pause or a long step), then on again
        beats = [i * period for i in range(20)]
        beats += [beats[-1] + period + pause + i * period for i in range(20)]
        assert _found_dead_at(beats, liveness_s, reaps) is None, pause
    beats = [i * period for i in range(20)]
    beats += [beats[-1] + liveness_s + 0.1 + i * period for i in range(20)]
    assert _found_dead_at(beats, liveness_s, reaps) is not None  # a longer silence is death


def test_lapsed_names_the_workers_whose_liveness_ended_by_now() -> None:
    live = {"a": 10.0, "b": 12.0, "c": 9.5}
    assert lapsed(live, 9.0) == []
    assert lapsed(live, 10.0) == ["a", "c"]  # lapsing at `now` is lapsed
    assert lapsed(live, 12.5) == ["a", "b", "c"]
    assert lapsed({}, 100.0) == []


def test_only_a_worker_whose_own_beats_went_through_for_a_full_liveness_reaps() -> None:
    assert not may_reap(None, 100.0, 2.0)  # its last beat failed: cut off, as others may be
    assert not may_reap(99.0, 100.0, 2.0)  # back a second ago: the others may not have beaten
    assert may_reap(98.0, 100.0, 2.0)
    assert may_reap(10.0, 100.0, 2.0)


def test_a_beat_held_back_past_the_last_ones_liveness_starts_the_count_again() -> None:
    assert beating_since(None, None, 5.0) == 5.0  # the first beat, or the first after a failure
    assert beating_since(1.0, 7.0, 6.0) == 1.0  # landed while the last beat still covered it
    # held back by an outage (it did not fail) past the last beat's liveness: others may have
    # taken this worker for dead meanwhile, and reaped
    assert beating_since(1.0, 7.0, 9.0) == 9.0
