"""Admission by estimated queue wait: how long a new job would wait before a worker starts it,
and whether that refuses it (a deadline it cannot meet, or a queue-wait SLO). Pure, with
injected inputs and time; the gateway reads the inputs (`gateway/shedding.py`).

The wait is (work ahead of the job) / (the fleet's measured completion rate). Work ahead, in
jobs: every job waiting in a higher-priority lane (strict priority), the jobs already in the
job's own lane stream (the fair-share window), the tenant's own staged jobs, and the other
tenants' staged jobs that fair share serves before this one — with `k` of its own jobs ahead
and weight `w`, tenant `i` (weight `w_i`, `s_i` staged) gets about `min(s_i, (k+1)·w_i/w)` turns
first, so a small tenant does not wait behind a big tenant's whole backlog. Jobs held by
workers beyond their slots (the claim-ahead reserve) wait too; the job starts when the
completion that frees a slot for it comes: (ahead + 1 - slots) completions from now. Jobs
are counted, not tokens: the completion rate is measured in jobs of the current mix.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import msgspec

from tokenyard.broker.core import LaneBacklog, TenantBacklog
from tokenyard.messages import Priority, WorkerInfo


def jobs_ahead(
    lanes: Sequence[LaneBacklog], tenant: str, weight: float, priority: Priority
) -> float:
    """Jobs a new job of `tenant` (weight, lane priority) would have to wait for, including the
    ones running now (subtract the fleet's slots for the queue proper)."""
    ahead = 0.0
    for lane in lanes:
        if lane.priority < priority:  # strict priority: all of it first
            ahead += lane.queued + lane.in_flight + sum(t.staged for t in lane.tenants)
        elif lane.priority == priority:
            ahead += lane.queued + lane.in_flight
            own = next((t.staged for t in lane.tenants if t.tenant == tenant), 0)
            turns = (own + 1) / max(weight, 1e-9)  # virtual time until this job's turn
            ahead += own + sum(
                min(t.staged, turns * t.weight) for t in lane.tenants if t.tenant != tenant
            )
        else:  # lower lanes only hold the slots their running jobs use
            ahead += lane.in_flight
    return ahead


def with_admitted(
    lanes: Sequence[LaneBacklog], tenant: str, weight: float, priority: Priority
) -> list[LaneBacklog]:
    """`lanes` with one more job staged for `tenant`: what this gateway admitted since it last
    read the lanes counts at once, so a burst between two reads cannot overshoot."""
    out = []
    for lane in lanes:
        if lane.priority == priority:
            tenants = [
                TenantBacklog(t.tenant, t.staged + 1, t.weight) if t.tenant == tenant else t
                for t in lane.tenants
            ]
            if not any(t.tenant == tenant for t in lane.tenants):
                tenants.append(TenantBacklog(tenant, 1, weight))
            lane = LaneBacklog(lane.priority, lane.queued, lane.in_flight, tenants)
        out.append(lane)
    return out


def queue_wait(
    lanes: Sequence[LaneBacklog],
    tenant: str,
    weight: float,
    priority: Priority,
    *,
    slots: int,
    rate: float | None,
) -> float | None:
    """Seconds a new job would wait before it starts; None when no rate has been measured yet
    (cold start: nothing to estimate from, so the caller admits)."""
    if rate is None or rate <= 0:
        return None
    # with every slot busy, the job starts at the completion that frees the last one ahead
    # of it: the (ahead - slots + 1)-th from now
    queued = jobs_ahead(lanes, tenant, weight, priority) + 1 - slots
    return max(0.0, queued) / rate


class Refusal(msgspec.Struct, frozen=True):
    """Why a job is refused at submit, and when a retry could be admitted (None: it cannot)."""

    reason: str  # "deadline" | "overloaded"
    wait_s: float
    retry_after_s: int | None


# a longer Retry-After than this is not useful to a client (OpenAI's client caps its wait at 60 s)
MAX_RETRY_AFTER_S = 60


def refusal(
    wait_s: float | None, *, now: float, deadline: float | None, slo_s: float | None
) -> Refusal | None:
    """Refuse a job whose deadline (unix seconds, the latest start) falls before its estimated
    start, or, without a deadline of its own, whose estimated wait exceeds the SLO.

    A deadline refusal has no Retry-After: the same deadline only gets closer. An SLO refusal
    retries once the queue has drained by the excess (1 s of wait per second, with no new
    arrivals), at least 1 s and at most MAX_RETRY_AFTER_S."""
    if wait_s is None:
        return None
    if deadline is not None:
        if now + wait_s > deadline:
            return Refusal("deadline", wait_s, None)
        return None
    if slo_s is not None and slo_s > 0 and wait_s > slo_s:
        retry = min(MAX_RETRY_AFTER_S, max(1, math.ceil(wait_s - slo_s)))
        return Refusal("overloaded", wait_s, retry)
    return None


class Shortfall:
    """How far recent estimates fell short of the waits that followed: the `quantile` of
    actual / estimated over the last `window` live calls estimated to wait at least `floor_s`
    (shorter estimates are dominated by one job's discreteness). Admission scales estimates by
    it, never below 1 and at most `cap`: under overload the queue sits at the SLO's edge, so an
    estimate a few percent short would put the tail of admitted calls a few percent past it."""

    def __init__(
        self, window: int = 200, quantile: float = 0.95, floor_s: float = 1.0, cap: float = 2.0
    ) -> None:
        self.quantile, self.floor_s, self.cap = quantile, floor_s, cap
        self._ratios: deque[float] = deque(maxlen=window)
        self.factor = 1.0

    def observe(self, estimated_s: float, actual_s: float) -> None:
        """A live call's estimated wait at admission and the wait it had."""
        if estimated_s < self.floor_s:
            return
        self._ratios.append(actual_s / estimated_s)
        ranked = sorted(self._ratios)
        at = ranked[min(len(ranked) - 1, int(self.quantile * len(ranked)))]
        self.factor = min(self.cap, max(1.0, at))

    def scaled(self, wait_s: float | None) -> float | None:
        return None if wait_s is None else wait_s * self.factor


def _ema(old: float | None, new: float, dt: float, halflife_s: float) -> float:
    if old is None:
        return new
    keep = 0.5 ** (dt / halflife_s) if halflife_s > 0 else 0.0
    return keep * old + (1 - keep) * new


class _Beat(msgspec.Struct):
    at: float
    jobs_done: int
    slots_used: int
    busy_s: float
    capacity: float | None = None  # jobs/s this worker completes with all its slots busy
    # every read since this heartbeat first came found jobs waiting: the interval it opens
    # ran saturated only if the read that closes it finds them too
    saturated: bool = False


class ServiceRate:
    """A model's fleet completion rate (jobs/s) measured from its workers' heartbeats.

    Between two heartbeats of one worker, `jobs_done` grew by `n` over `dt`: it completed
    n/dt jobs/s. While jobs wait for the workers (`saturated`, at every read from one heartbeat
    to the next) that is all it can do, so it is its capacity as measured. Otherwise it held
    `busy` jobs on average (its slot-seconds over dt), and with all `slots` busy it would do
    about slots·(n/dt)/busy (Little's law, as autoscale.Estimator); scaling a saturated
    worker's rate this way would overestimate it, as its running count dips between a job's end
    and the next one's start. The fleet's rate is the sum over live, non-draining workers of
    their smoothed capacities. A worker not measured yet counts as the mean of those that are.
    """

    def __init__(self, halflife_s: float = 5.0) -> None:
        self.halflife_s = halflife_s
        self._beats: dict[str, _Beat] = {}
        self.rate: float | None = None
        self.slots = 0

    def observe(self, workers: Sequence[WorkerInfo], saturated: bool = False) -> float | None:
        """Fold in the workers' latest heartbeats (`saturated`: jobs are waiting for them);
        the fleet rate (None: not measured yet)."""
        beats: dict[str, _Beat] = {}
        for info in workers:
            last = self._beats.get(info.consumer)
            beat = _Beat(info.at, info.jobs_done, info.slots_used, info.busy_s)
            beat.saturated = saturated
            if last is None:
                beats[info.consumer] = beat
                continue
            beat.capacity = last.capacity
            dt = info.at - last.at
            done = info.jobs_done - last.jobs_done
            if dt <= 0:  # the same heartbeat again: keep the interval's start
                last.saturated = last.saturated and saturated
                beats[info.consumer] = last
                continue
            # a burst that finds an idle worker waits at this read, but the interval before it
            # was idle: its few completions are no measure of capacity
            throughout = last.saturated and saturated
            held = info.busy_s - last.busy_s
            # the slots held on average: exact from the worker's slot-seconds; a worker that
            # does not report them is sampled at its two heartbeats
            busy = held / dt if held > 0 else (info.slots_used + last.slots_used) / 2
            if done > 0 and (busy > 0 or throughout):
                sample = done / dt
                if not throughout:
                    sample *= max(1, info.slots_total) / max(busy, 1.0)
                beat.capacity = _ema(last.capacity, sample, dt, self.halflife_s)
            beats[info.consumer] = beat
        self._beats = beats  # workers gone from the registry are forgotten
        live = [w for w in workers if w.state != "draining"]
        self.slots = sum(max(1, w.slots_total) for w in live)
        known = [c for w in live if (c := beats[w.consumer].capacity) is not None]
        if not known:
            self.rate = None
        else:
            self.rate = sum(known) / len(known) * len(live)
        return self.rate
