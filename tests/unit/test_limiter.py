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


# -- token budget per period -------------------------------------------------------------

PERIODS = st.sampled_from(["day", "month", "3600", "90.5"])


@given(PERIODS, st.floats(min_value=0, max_value=4e9))
def test_a_period_window_holds_now_and_its_successor_starts_at_its_end(
    period: str, now: float
) -> None:
    start, end = limiter.period_window(now, period)
    assert start <= now < end
    nxt_start, _ = limiter.period_window(end, period)
    assert nxt_start == end
    if period == "month":
        first = limiter.datetime.fromtimestamp(start, limiter.UTC)
        assert (first.day, first.hour, first.minute, first.second) == (1, 0, 0, 0)
        assert 28 * 86400 <= end - start <= 31 * 86400


@given(
    st.integers(min_value=1, max_value=5000),
    PERIODS,
    st.lists(
        st.tuples(st.floats(min_value=0, max_value=200_000), st.integers(1, 800)),
        max_size=60,
    ),
)
def test_a_budget_never_admits_more_than_it_holds_in_any_period(
    budget: int, period: str, arrivals: list[tuple[float, int]]
) -> None:
    state, quota = QuotaState(), Quota(token_budget=budget, budget_period=period)
    spent: dict[float, int] = {}
    for now, tokens in sorted(arrivals):
        start, end = limiter.period_window(now, period)
        decision = limiter.admit(state, quota, tokens, now)
        used = spent.get(start, 0)
        # admitted exactly when it fits what is left of this period's budget
        assert decision.admitted == (used + tokens <= budget)
        if decision.admitted:
            spent[start] = used + tokens
        else:
            assert decision.reason == ("budget" if tokens <= budget else "too_large")
            if tokens <= budget:
                assert math.isclose(decision.retry_after_s, end - now)
                headers = limiter.headers(decision)
                assert int(headers["retry-after"]) == max(1, math.ceil(end - now))
            else:
                assert math.isinf(decision.retry_after_s)  # never fits: no Retry-After
    assert all(used <= budget for used in spent.values())


@given(st.integers(10, 1000), st.integers(0, 10), st.floats(min_value=0, max_value=1e9))
def test_a_settled_job_refunds_its_unused_tokens_in_its_own_period_only(
    budget: int, actual: int, now: float
) -> None:
    state, quota = QuotaState(), Quota(token_budget=budget, budget_period="day")
    assert limiter.admit(state, quota, budget, now).admitted
    start, end = limiter.period_window(now, "day")
    assert not limiter.admit(state, quota, 1, now).admitted
    limiter.settle(state, 0.0, reserved=budget, actual=actual, budget_start=start)
    assert state.budget_used == actual
    assert limiter.admit(state, quota, budget - actual, now).admitted
    # a job reserved in the period before refunds nothing into the next one
    fresh, later = QuotaState(), end + 1.0
    assert limiter.admit(fresh, quota, budget, now).admitted
    assert limiter.admit(fresh, quota, budget, later).admitted
    limiter.settle(fresh, 0.0, reserved=budget, actual=0, budget_start=start)
    assert fresh.budget_used == budget


def test_a_budget_refusal_keeps_the_rate_limit_headers() -> None:
    state, quota = QuotaState(), Quota(rpm=10, tpm=1000, token_budget=100)
    assert limiter.admit(state, quota, 80, now=50.0).admitted
    refused = limiter.admit(state, quota, 30, now=50.0)
    assert refused.reason == "budget" and math.isclose(refused.retry_after_s, 86400 - 50)
    headers = limiter.headers(refused)
    assert headers["x-ratelimit-limit-requests"] == "10"
    assert headers["x-ratelimit-remaining-requests"] == "9"  # the refusal took nothing
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["retry-after"] == str(86400 - 50)
    assert limiter.admit(state, quota, 30, now=86400.0).admitted  # the next day
