"""Autoscaling policy: desired workers per model from the queue; pure, with injected time.

`Estimator` turns raw observations (lane depths, workers' heartbeats) into rates;
`desired_workers` is the sizing rule (Little's law against a queue-time SLO);
`Autoscaler` adds the warm pool, scale-to-zero, cooldowns, hysteresis and drain-aware
scale-down. No I/O here: `tokenyard/fleet/supervisor.py` feeds it and carries out its decisions.
"""

from __future__ import annotations

import math
from collections import deque

import msgspec


class AutoscaleConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The knobs of one model's policy; each can be set by TOKENYARD_AUTOSCALE_<FIELD>."""

    min_workers: int = 1  # the warm pool kept while traffic flows
    max_workers: int = 4
    scale_to_zero: bool = False  # below the warm pool, to none, after `zero_after_s` idle
    zero_after_s: float = 300.0
    slo_queue_s: float = 5.0  # target time a job waits in its lane before a worker claims it
    # a new worker's start (process, model load) before it claims: a backlog cannot be cleared
    # faster than that by starting workers, so it is spread over max(SLO, startup)
    startup_s: float = 0.0
    target_utilization: float = 0.8  # of a worker's measured capacity
    tolerance: float = 0.1  # no change while the need is within this fraction of the fleet
    up_cooldown_s: float = 10.0  # after a scale-up, before the next one
    down_cooldown_s: float = 60.0  # after any change, before a scale-down
    down_window_s: float = 60.0  # scale down only to the highest need seen in this window
    up_factor: float = 2.0  # one scale-up grows the fleet at most this many times ...
    up_min_step: int = 4  # ... or by this many workers, whichever is more
    max_down_step: int = 1  # workers drained at once; the next drain waits for them to leave
    rate_halflife_s: float = 10.0  # smoothing of the measured rates
    default_service_rate: float = 1.0  # jobs/s per worker before one has been measured
    tick_s: float = 1.0  # how often the supervisor observes and decides


class WorkerLoad(msgspec.Struct, frozen=True):
    """One live worker as its heartbeat shows it."""

    consumer: str
    state: str = "running"  # running | draining
    slots_used: int = 0
    slots_total: int = 1
    jobs_done: int = 0


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    """What the supervisor saw at `at`: the model's lanes and its live workers."""

    at: float
    waiting: int
    in_flight: int
    oldest_age_s: float | None = None
    workers: list[WorkerLoad] = msgspec.field(default_factory=list)
    starting: int = 0  # launched, not yet heartbeating


class Signals(msgspec.Struct, frozen=True, kw_only=True):
    """The policy's inputs, also exported as gauges for external autoscalers."""

    at: float
    arrival_rate: float  # jobs/s entering the lanes (smoothed)
    service_rate: float  # jobs/s one worker completes with all its slots busy (smoothed)
    waiting: int
    in_flight: int
    oldest_age_s: float
    running: int  # live, not draining
    draining: int
    starting: int
    slots_per_worker: float


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What to do now: start this many workers, drain these consumers."""

    at: float
    desired: int  # the fleet size the policy wants (the exported gauge)
    need: float  # the unrounded Little's-law need, before bounds and hysteresis
    start: int = 0
    drain: list[str] = msgspec.field(default_factory=list)
    reason: str = "steady"
    signals: Signals


def _ema(old: float | None, new: float, dt: float, halflife_s: float) -> float:
    if old is None:
        return new
    keep = 0.5 ** (dt / halflife_s) if halflife_s > 0 else 0.0
    return keep * old + (1 - keep) * new


class Estimator:
    """Arrival and per-worker service rates from successive observations.

    Arrivals are a flow balance: what entered the lanes = growth of waiting + in flight plus
    what completed (the workers' `jobs_done` counters), so the broker needs no extra counter.
    A worker's capacity follows from Little's law: with `busy` jobs held and `c` completions
    per second, a job takes busy/c seconds, so a full worker does slots·c/busy per second.
    """

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._last: Observation | None = None
        self.arrival_rate: float | None = None
        self.service_rate: float | None = None
        self.arrivals = 0.0  # seen in the last interval (not smoothed)

    def update(self, obs: Observation) -> Signals:
        last, self._last = self._last, obs
        live = [w for w in obs.workers if w.state != "draining"]
        slots = sum(w.slots_total for w in obs.workers) / len(obs.workers) if obs.workers else 0.0
        if last is not None and obs.at > last.at:
            dt = obs.at - last.at
            done_before = {w.consumer: w.jobs_done for w in last.workers}
            completed = sum(
                max(0, w.jobs_done - done_before[w.consumer])
                for w in obs.workers
                if w.consumer in done_before
            )
            depth_growth = (obs.waiting + obs.in_flight) - (last.waiting + last.in_flight)
            self.arrivals = max(0.0, depth_growth + completed)
            hl = self.config.rate_halflife_s
            self.arrival_rate = _ema(self.arrival_rate, self.arrivals / dt, dt, hl)
            # jobs held, averaged over the interval; the claim-ahead reserve counts as held,
            # which makes the capacity estimate err low (towards more workers)
            busy = (last.in_flight + obs.in_flight) / 2
            if completed > 0 and busy > 0 and slots > 0:
                per_job_s = busy / (completed / dt)
                self.service_rate = _ema(self.service_rate, slots / per_job_s, dt, hl)
        return Signals(
            at=obs.at,
            arrival_rate=self.arrival_rate or 0.0,
            service_rate=self.service_rate or self.config.default_service_rate,
            waiting=obs.waiting,
            in_flight=obs.in_flight,
            oldest_age_s=obs.oldest_age_s or 0.0,
            running=len(live),
            draining=len(obs.workers) - len(live),
            starting=obs.starting,
            slots_per_worker=slots,
        )


def desired_workers(s: Signals, config: AutoscaleConfig) -> float:
    """Workers needed, unrounded: serve arrivals and clear the backlog within the SLO.

    Little's law: to keep a job's lane wait under W with arrivals at λ, the lane may hold at
    most λ·W, and the fleet must serve λ plus the backlog over W. Held jobs bound it too (a
    worker holds `slots` at most), and a backlog older than the SLO asks for one more worker.
    """
    capacity = max(s.service_rate, 1e-9) * config.target_utilization
    horizon = max(config.slo_queue_s, config.startup_s)
    need = (s.arrival_rate + s.waiting / horizon) / capacity
    if s.slots_per_worker > 0:
        need = max(need, s.in_flight / (s.slots_per_worker * config.target_utilization))
    if s.waiting > 0 and s.oldest_age_s > config.slo_queue_s:
        need = max(need, s.running + s.starting + 1)
    if s.waiting + s.in_flight > 0:
        need = max(need, 1.0)
    return need


class Autoscaler:
    """One model's fleet size over time: bounds, cooldowns, hysteresis, drain-aware scale-down."""

    def __init__(self, config: AutoscaleConfig, now: float) -> None:
        self.config = config
        self.estimator = Estimator(config)
        self._last_up = -math.inf
        self._last_change = -math.inf
        self._busy_at = now  # last time there was anything to do; scale-to-zero counts from it
        self._window: deque[tuple[float, int]] = deque()
        self.draining: set[str] = set()  # drains we asked for that have not left yet

    def step(self, obs: Observation) -> Decision:
        cfg = self.config
        s = self.estimator.update(obs)
        now = obs.at
        present = {w.consumer for w in obs.workers}
        if self.draining - present:
            self._last_change = now  # the down cooldown runs from the end of a drain
        self.draining &= present  # a drained worker deregisters when it leaves
        if obs.waiting + obs.in_flight > 0 or self.estimator.arrivals > 0:
            self._busy_at = now
        current = sum(
            1 for w in obs.workers if w.state != "draining" and w.consumer not in self.draining
        )
        current += obs.starting
        need = desired_workers(s, cfg)

        if cfg.scale_to_zero and now - self._busy_at >= cfg.zero_after_s:
            # nothing queued, held or arriving for the whole spell: what is left of the
            # smoothed arrival rate is history, not load
            floor = target = 0
        else:
            floor = max(cfg.min_workers, 1 if need > 0 else 0)
            target = min(cfg.max_workers, max(floor, math.ceil(need - 1e-9)))
            # hysteresis: inside the tolerance band the fleet stays as it is
            within = current > 0 and abs(need / current - 1) <= cfg.tolerance
            if within and floor <= current <= cfg.max_workers:
                target = current

        self._window.append((now, target))
        while self._window and self._window[0][0] < now - cfg.down_window_s:
            self._window.popleft()
        # a scale-down goes only to the highest target of the window (flapping damper)
        down_to = max(t for _, t in self._window)

        # the fleet size the policy is heading for (the exported gauge); this tick's actions
        # may be a step towards it, or none while a cooldown or a drain runs
        goal = target if target > current else min(current, down_to)

        def decide(reason: str, start: int = 0, drain: list[str] | None = None) -> Decision:
            return Decision(
                at=now,
                desired=goal,
                need=need,
                start=start,
                drain=drain or [],
                reason=reason,
                signals=s,
            )

        if target > current:
            cooling = now - self._last_up < cfg.up_cooldown_s
            if cooling and current >= max(1, cfg.min_workers):  # below the floor: at once
                return decide("up-cooldown")
            step = max(cfg.up_min_step, math.ceil(current * (cfg.up_factor - 1)))
            start = min(target - current, step)
            self._last_up = self._last_change = now
            return decide("up", start=start)
        if down_to < current:
            if self.draining:
                return decide("draining")  # wait for the last drain to leave first
            if now - self._last_change < cfg.down_cooldown_s:
                return decide("down-cooldown")
            chosen = pick_to_drain(
                [w for w in obs.workers if w.state != "draining"],
                min(current - down_to, cfg.max_down_step),
            )
            if not chosen:  # only starting workers above the target: wait for them
                return decide("down-wait")
            self.draining.update(chosen)
            self._last_change = now
            return decide("down", drain=chosen)
        return decide("steady")


def pick_to_drain(workers: list[WorkerLoad], n: int) -> list[str]:
    """The `n` least-loaded workers: fewest jobs held drains fastest and hands back least."""
    ranked = sorted(workers, key=lambda w: (w.slots_used, w.jobs_done, w.consumer))
    return [w.consumer for w in ranked[:n]]
