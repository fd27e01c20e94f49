"""The quota maths with injected time: GCRA bounds, refunds, and the rate-limit headers."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from tokenyard.tenancy import limiter
from tokenyard.tenancy.limiter import Quota, QuotaState


def test_a_burst_gets_exactly_the_limit_then_waits_one_interval() -> None:
    state, quota = QuotaState(), Quota(rpm=6)
    decisions = [limiter.admit(state, quota, 1, now=100.0) for _ in range(8)]
    assert [d.admitted for d in decisions] == [True] * 6 + [False] * 2
    assert [d.requests[1] for d in decisions[:6] if d.requests] == [5, 4, 3, 2, 1, 0]
    refused = decisions[6]
    assert refused.reason == "requests" and math.isclose(refused.retry_after_s, 10.0)
    assert not limiter.admit(state, quota, 1, now=109.9).admitted
    assert limiter.admit(state, quota, 1, now=110.0).admitted


def test_tokens_are_refunded_at_settle_and_concurrency_released() -> None:
    state, quota = QuotaState(), Quota(tpm=1000, max_concurrent=2)
    assert limiter.admit(state, quota, 600, now=0.0).admitted
    assert limiter.admit(state, quota, 300, now=0.0).admitted
    full = limiter.admit(state, quota, 50, now=0.0)
    assert not full.admitted and full.reason == "concurrency"
    limiter.settle(state, 60 / 1000, reserved=600, actual=100)  # 500 come back
    assert state.active == 1
    again = limiter.admit(state, quota, 550, now=0.0)
    assert again.admitted and again.tokens is not None and again.tokens[1] == 50
    too_big = limiter.admit(QuotaState(), quota, 1001, now=0.0)
    assert too_big.reason == "too_large" and math.isinf(too_big.retry_after_s)
    assert "retry-after" not in limiter.headers(too_big)


@given(
    limit=st.integers(min_value=1, max_value=50),
    gaps=st.lists(st.floats(min_value=0.0, max_value=5.0), min_size=1, max_size=200),
)
def test_no_window_admits_more_than_the_limit_plus_its_refill(
    limit: int, gaps: list[float]
) -> None:
    """Over any span of W seconds GCRA admits at most limit + W * limit / 60 requests."""
    state, quota, now, admitted = QuotaState(), Quota(rpm=limit), 0.0, []
    for gap in gaps:
        now += gap
        if limiter.admit(state, quota, 1, now).admitted:
            admitted.append(now)
    for i, start in enumerate(admitted):
        for j in range(i, len(admitted)):
            span = admitted[j] - start
            assert j - i + 1 <= limit + span * limit / 60 + 1e-6


@given(st.integers(min_value=1, max_value=100), st.floats(min_value=0, max_value=1e6))
def test_a_fresh_limiter_admits_a_full_burst(limit: int, now: float) -> None:
    state, quota = QuotaState(), Quota(rpm=limit)
    assert all(limiter.admit(state, quota, 1, now).admitted for _ in range(limit))
    refused = limiter.admit(state, quota, 1, now)
    assert not refused.admitted and 0 < refused.retry_after_s <= 60 / limit + 1e-6


def test_headers_use_openai_names_and_formats() -> None:
    state, quota = QuotaState(), Quota(rpm=2, tpm=100)
    ok = limiter.admit(state, quota, 40, now=0.0)
    assert limiter.headers(ok) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
        "x-ratelimit-limit-tokens": "100",
        "x-ratelimit-remaining-tokens": "60",
        "x-ratelimit-reset-tokens": "24s",
    }
    limiter.admit(state, quota, 40, now=0.0)
    refused = limiter.headers(limiter.admit(state, quota, 1, now=0.5))
    assert refused["retry-after"] == "30" and refused["x-ratelimit-remaining-requests"] == "0"
    assert [limiter.duration(s) for s in (0.02, 1.5, 360.0, 61.25)] == [
        "20ms",
        "1.5s",
        "6m0s",
        "1m1.25s",
    ]
