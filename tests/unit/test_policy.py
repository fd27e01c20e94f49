"""Backoff and claim-order policy: pure functions with seeded randomness."""

from __future__ import annotations

import random
from collections import Counter

from tokenyard.broker.policy import backoff_delay, claim_order


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
