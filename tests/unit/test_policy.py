"""Backoff and claim-order policy: pure functions with seeded randomness."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tokenyard.broker.policy import (
    backoff_delay,
    claim_order,
    estimated_tokens,
    joinable,
    pools_served,
    size_pool,
)
from tokenyard.config import parse_pool_bounds
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
