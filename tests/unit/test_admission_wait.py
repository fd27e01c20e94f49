"""The queue-wait estimate, its refusals and the measured service rate (pure, injected inputs)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenyard.broker.core import LaneBacklog, TenantBacklog
from tokenyard.gateway.admission_wait import (
    MAX_RETRY_AFTER_S,
    Refusal,
    ServiceRate,
    Shortfall,
    jobs_ahead,
    queue_wait,
    refusal,
    with_admitted,
)
from tokenyard.messages import Priority, WorkerInfo


def lane(
    priority: Priority = Priority.NORMAL, queued: int = 0, in_flight: int = 0, **staged: int
) -> LaneBacklog:
    return LaneBacklog(
        priority, queued, in_flight, [TenantBacklog(t, n, 1.0) for t, n in staged.items()]
    )


def test_a_small_tenant_does_not_wait_behind_a_big_tenants_backlog() -> None:
    lanes = [lane(queued=4, in_flight=8, big=2000, small=1)]
    # small: its own 1 job, then its turn comes after about 2 of big's
    assert jobs_ahead(lanes, "small", 1.0, Priority.NORMAL) == 4 + 8 + 1 + 2
    # big waits behind its whole backlog, and small's one job
    assert jobs_ahead(lanes, "big", 1.0, Priority.NORMAL) == 4 + 8 + 2000 + 1
    # a new tenant's first job waits one turn of each active tenant
    assert jobs_ahead(lanes, "new", 1.0, Priority.NORMAL) == 4 + 8 + 1 + 1


def test_weights_scale_the_other_tenants_turns() -> None:
    lanes = [LaneBacklog(Priority.NORMAL, 0, 0, [TenantBacklog("a", 100, 3.0)])]
    # b's first job (weight 1): a gets 3 turns per turn of b
    assert jobs_ahead(lanes, "b", 1.0, Priority.NORMAL) == 3
    # b with weight 3 gets as many turns as a
    assert jobs_ahead(lanes, "b", 3.0, Priority.NORMAL) == 1


def test_strict_priority_higher_lanes_count_whole_lower_lanes_only_their_running_jobs() -> None:
    lanes = [
        lane(Priority.HIGH, queued=2, in_flight=1, x=10),
        lane(Priority.NORMAL, queued=1),
        lane(Priority.LOW, queued=50, in_flight=3, y=100),
    ]
    assert jobs_ahead(lanes, "t", 1.0, Priority.NORMAL) == 13 + 1 + 3
    # its own lane: the window, the running job, one turn of x; below: only running jobs
    assert jobs_ahead(lanes, "t", 1.0, Priority.HIGH) == 2 + 1 + 1 + 0 + 3


def test_wait_subtracts_the_fleets_slots_and_divides_by_the_rate() -> None:
    lanes = [lane(queued=19, in_flight=8)]
    # 27 ahead on 8 slots: it starts at the 20th completion from now
    assert queue_wait(lanes, "t", 1.0, Priority.NORMAL, slots=8, rate=4.0) == 5.0
    assert queue_wait([lane(in_flight=7)], "t", 1.0, Priority.NORMAL, slots=8, rate=4.0) == 0.0
    # cold start: no measured rate, no estimate (the caller admits)
    assert queue_wait(lanes, "t", 1.0, Priority.NORMAL, slots=8, rate=None) is None


def test_refusals() -> None:
    now = 1000.0
    assert refusal(None, now=now, deadline=now + 1, slo_s=1.0) is None
    # a deadline is the latest start: refused without Retry-After, whatever the SLO
    assert refusal(5.0, now=now, deadline=now + 4, slo_s=None) == Refusal("deadline", 5.0, None)
    assert refusal(5.0, now=now, deadline=now + 6, slo_s=1.0) is None
    # no deadline of its own: the SLO, Retry-After = the excess
    assert refusal(5.0, now=now, deadline=None, slo_s=None) is None
    assert refusal(5.0, now=now, deadline=None, slo_s=5.0) is None
    assert refusal(7.2, now=now, deadline=None, slo_s=5.0) == Refusal("overloaded", 7.2, 3)
    assert refusal(5.1, now=now, deadline=None, slo_s=5.0) == Refusal("overloaded", 5.1, 1)
    far = refusal(900.0, now=now, deadline=None, slo_s=5.0)
    assert far is not None and far.retry_after_s == MAX_RETRY_AFTER_S


@given(
    own=st.integers(0, 500),
    others=st.lists(st.tuples(st.integers(0, 500), st.floats(0.1, 10)), max_size=5),
    more=st.integers(1, 50),
)
def test_more_staged_work_never_shortens_the_wait(
    own: int, others: list[tuple[int, float]], more: int
) -> None:
    def ahead(own_n: int, bump: int) -> float:
        tenants = [TenantBacklog("me", own_n, 1.0)] + [
            TenantBacklog(f"t{i}", n + (bump if i == 0 else 0), w)
            for i, (n, w) in enumerate(others)
        ]
        return jobs_ahead([LaneBacklog(Priority.NORMAL, 0, 0, tenants)], "me", 1.0, Priority.NORMAL)

    base = ahead(own, 0)
    assert ahead(own + more, 0) >= base + more
    assert ahead(own, more) >= base
    # and never more than the whole lane plus this job
    assert base <= own + sum(n for n, _ in others) + 1


def beat(consumer: str, at: float, done: int, used: int, total: int = 4, **kw: str) -> WorkerInfo:
    return WorkerInfo(
        consumer=consumer,
        model="m",
        engine="sim",
        host="h",
        pid=1,
        started_at=0.0,
        at=at,
        jobs_done=done,
        slots_used=used,
        slots_total=total,
        **kw,  # type: ignore[arg-type]
    )


def test_service_rate_from_heartbeats() -> None:
    rate = ServiceRate(halflife_s=0.0)  # no smoothing: the last interval
    assert rate.observe([beat("w1", 10.0, 0, 4)]) is None  # one heartbeat: nothing yet
    assert rate.slots == 4
    # the same heartbeat read again changes nothing
    assert rate.observe([beat("w1", 10.0, 0, 4)]) is None
    # 8 jobs in 2 s with all 4 slots busy: 4 jobs/s
    assert rate.observe([beat("w1", 12.0, 8, 4)]) == pytest.approx(4.0)
    # 2 jobs/s holding 3 on average: a full worker (4 slots) would do 8/3 (Little's law)
    assert rate.observe([beat("w1", 14.0, 12, 2)]) == pytest.approx(8 / 3)
    # a second worker not measured yet counts as the mean; a draining one does not count
    got = rate.observe([beat("w1", 14.0, 12, 2), beat("w2", 14.0, 0, 0)])
    assert got == pytest.approx(2 * 8 / 3) and rate.slots == 8
    got = rate.observe([beat("w1", 14.0, 12, 2), beat("w2", 14.0, 0, 0, state="draining")])
    assert got == pytest.approx(8 / 3) and rate.slots == 4
    # a worker gone from the registry is forgotten
    assert rate.observe([]) is None and rate.slots == 0


def test_a_saturated_workers_completion_rate_is_its_capacity() -> None:
    rate = ServiceRate(halflife_s=0.0)
    rate.observe([beat("w", 0.0, 0, 3)], saturated=True)
    # 5 jobs/s; it held 3 of 4 at those instants (between one job's end and the next's start),
    # but jobs were waiting: scaling by 4/3 would promise more than it does
    assert rate.observe([beat("w", 2.0, 10, 3)], saturated=True) == pytest.approx(5.0)
    assert rate.observe([beat("w", 4.0, 20, 3)], saturated=False) == pytest.approx(20 / 3)


def test_a_burst_after_idle_time_is_no_measure_of_capacity() -> None:
    # Found on a GPU: a worker finished its warm-up, sat idle, then a burst of requests came;
    # the first read that saw them waiting took the idle interval's two completions for the
    # worker's whole capacity (1 job/s) and refused the burst's tail as a 30 s queue wait.
    rate = ServiceRate(halflife_s=0.0)
    rate.observe([beat("w", 0.0, 0, 0, busy_s=0.0)])  # type: ignore[arg-type]
    # 2 jobs in 2 s holding 2 slot-seconds (1 of 4 slots on average), jobs waiting only now
    got = rate.observe([beat("w", 2.0, 2, 0, total=4, busy_s=2.0)], saturated=True)  # type: ignore[arg-type]
    assert got == pytest.approx(2 / 2 * 4 / 1)  # Little's law: 4 jobs/s with all 4 busy, not 1
    # an interval with jobs waiting at both ends is the capacity as measured
    got = rate.observe([beat("w", 4.0, 20, 4, total=4, busy_s=9.0)], saturated=True)  # type: ignore[arg-type]
    assert got == pytest.approx(9.0)
    # one read without waiting jobs in between: that interval is scaled again
    rate.observe([beat("w", 4.0, 20, 4, total=4, busy_s=9.0)], saturated=False)  # type: ignore[arg-type]
    got = rate.observe([beat("w", 6.0, 30, 4, total=4, busy_s=13.0)], saturated=True)  # type: ignore[arg-type]
    assert got == pytest.approx(10 / 2 * 4 / 2)


def test_slot_seconds_give_the_mean_held_not_two_instants() -> None:
    rate = ServiceRate(halflife_s=0.0)
    rate.observe([beat("w", 0.0, 0, 0, busy_s=0.0)])  # type: ignore[arg-type]
    # 4 jobs in 2 s while it held 2 on average (4 slot-seconds), though both heartbeats
    # caught it between jobs (0 running): a full worker does 4 · 2 / 2 = 4 jobs/s
    got = rate.observe([beat("w", 2.0, 4, 0, busy_s=4.0)])  # type: ignore[arg-type]
    assert got == pytest.approx(4.0)
    # sampled at the instants instead (1 and 0 running), it would claim 4 · 2 / 1 = 8
    sampled = ServiceRate(halflife_s=0.0)
    sampled.observe([beat("w", 0.0, 0, 1)])
    assert sampled.observe([beat("w", 2.0, 4, 0)]) == pytest.approx(8.0)


def test_service_rate_smooths() -> None:
    rate = ServiceRate(halflife_s=2.0)
    rate.observe([beat("w", 0.0, 0, 4)])
    assert rate.observe([beat("w", 2.0, 8, 4)]) == pytest.approx(4.0)  # the first sample
    # one half-life later at 8 jobs/s: halfway
    assert rate.observe([beat("w", 4.0, 24, 4)]) == pytest.approx(6.0)


def test_admitted_jobs_count_until_the_next_read() -> None:
    lanes = [lane(Priority.HIGH), lane(queued=1, a=2)]
    once = with_admitted(lanes, "a", 1.0, Priority.NORMAL)
    assert once[1].tenants == [TenantBacklog("a", 3, 1.0)] and once[0] == lanes[0]
    twice = with_admitted(once, "b", 2.0, Priority.NORMAL)
    assert twice[1].tenants == [TenantBacklog("a", 3, 1.0), TenantBacklog("b", 1, 2.0)]
    assert lanes[1].tenants == [TenantBacklog("a", 2, 1.0)]  # the input is not changed


def test_shortfall_scales_estimates_by_how_far_they_fell_short() -> None:
    short = Shortfall(window=20, quantile=0.95, floor_s=1.0)
    assert short.scaled(10.0) == 10.0 and short.scaled(None) is None  # nothing seen: as is
    short.observe(0.5, 2.0)  # under the floor: one job's discreteness, not the estimate's error
    assert short.factor == 1.0
    for _ in range(19):
        short.observe(10.0, 10.0)  # right
    short.observe(10.0, 11.0)  # one in twenty 10 % short: the 95th percentile
    assert short.factor == pytest.approx(1.1)
    assert short.scaled(28.0) == pytest.approx(30.8)  # a 28 s estimate now misses a 30 s SLO
    for _ in range(20):
        short.observe(10.0, 8.0)  # estimates too long never loosen admission past them
    assert short.factor == 1.0
    for _ in range(20):
        short.observe(1.0, 10.0)  # and a broken estimate tightens it at most `cap`-fold
    assert short.factor == 2.0
