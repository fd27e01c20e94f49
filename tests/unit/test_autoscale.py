"""Autoscaling policy: Little's-law sizing, bounds, cooldowns, hysteresis, drains; injected time."""

from __future__ import annotations

import pytest

from tokenyard.fleet.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    Decision,
    Estimator,
    Observation,
    Signals,
    WorkerLoad,
    desired_workers,
    pick_to_drain,
)

CFG = AutoscaleConfig(
    min_workers=1,
    max_workers=10,
    slo_queue_s=5.0,
    target_utilization=0.8,
    up_cooldown_s=10.0,
    down_cooldown_s=30.0,
    down_window_s=20.0,
    rate_halflife_s=0.0,  # no smoothing: each interval's rate as measured
)


def signals(**kw: float) -> Signals:
    base: dict[str, float] = dict(
        at=0.0, arrival_rate=0.0, service_rate=5.0, waiting=0, in_flight=0, oldest_age_s=0.0,
        running=1, draining=0, starting=0, slots_per_worker=8.0,
    )  # fmt: skip
    base.update(kw)
    return Signals(**base)  # type: ignore[arg-type]


def test_need_is_arrivals_plus_backlog_over_the_slo_by_usable_capacity() -> None:
    # 10 jobs/s over 5 jobs/s·0.8 per worker = 2.5 workers
    assert desired_workers(signals(arrival_rate=10.0), CFG) == pytest.approx(2.5)
    # plus 20 waiting to clear within 5 s: (10 + 4) / 4
    assert desired_workers(signals(arrival_rate=10.0, waiting=20), CFG) == pytest.approx(3.5)


def test_held_jobs_old_backlog_and_any_work_raise_the_need() -> None:
    # 24 jobs held at 8 slots, 80 %: 3.75 workers whatever the rates say
    assert desired_workers(signals(in_flight=24), CFG) == pytest.approx(3.75)
    # a backlog older than the SLO: one more than the fleet has
    assert desired_workers(signals(waiting=1, oldest_age_s=9.0, running=3), CFG) == 4
    assert desired_workers(signals(waiting=1), CFG) == 1.0  # anything queued needs a worker
    assert desired_workers(signals(), CFG) == 0.0


def test_estimator_measures_arrivals_by_flow_balance_and_capacity_by_littles_law() -> None:
    est = Estimator(CFG)
    w = [WorkerLoad("a", slots_total=8, jobs_done=100), WorkerLoad("b", slots_total=8)]
    est.update(Observation(at=0.0, waiting=10, in_flight=8, workers=w))
    w2 = [WorkerLoad("a", slots_total=8, jobs_done=110), WorkerLoad("b", slots_total=8)]
    s = est.update(Observation(at=2.0, waiting=14, in_flight=8, workers=w2))
    # 4 more waiting and 10 completed in 2 s: 7 arrivals/s
    assert s.arrival_rate == pytest.approx(7.0)
    # 8 held, 5 completions/s: 1.6 s a job; 8 slots → 5 jobs/s per full worker
    assert s.service_rate == pytest.approx(5.0)
    assert (s.running, s.slots_per_worker) == (2, 8.0)


def test_estimator_uses_the_default_rate_until_something_completes() -> None:
    est = Estimator(AutoscaleConfig(default_service_rate=3.0))
    s = est.update(Observation(at=0.0, waiting=5, in_flight=0))
    assert s.service_rate == 3.0 and s.arrival_rate == 0.0


class Trace:
    """A model's fleet as the policy sees it: workers with done counters, a queue, a clock."""

    def __init__(self, config: AutoscaleConfig = CFG, workers: int = 1) -> None:
        self.t = 0.0
        self.policy = Autoscaler(config, now=0.0)
        self.done: dict[str, int] = {f"w{i}": 0 for i in range(workers)}
        self.used: dict[str, int] = {}
        self.draining: set[str] = set()
        self.starting = 0
        self.serial = workers

    def step(self, dt: float, *, waiting: int, in_flight: int, per_worker_done: int) -> Decision:
        self.t += dt
        for name in self.done:
            self.done[name] += per_worker_done
        workers = [
            WorkerLoad(
                name,
                state="draining" if name in self.draining else "running",
                slots_used=self.used.get(name, 0),
                slots_total=8,
                jobs_done=done,
            )
            for name, done in self.done.items()
        ]
        decision = self.policy.step(
            Observation(
                at=self.t, waiting=waiting, in_flight=in_flight, workers=workers,
                starting=self.starting,
            )
        )  # fmt: skip
        self.starting += decision.start
        self.draining.update(decision.drain)
        return decision

    def arrive(self) -> None:
        """Started workers begin heartbeating."""
        for _ in range(self.starting):
            self.done[f"w{self.serial}"] = 0
            self.serial += 1
        self.starting = 0

    def leave(self, name: str) -> None:
        del self.done[name]
        self.draining.discard(name)

    @property
    def size(self) -> int:
        return len(self.done) - len(self.draining) + self.starting


def test_a_burst_scales_up_in_bounded_steps_with_a_cooldown_between() -> None:
    tr = Trace()
    tr.step(1.0, waiting=0, in_flight=4, per_worker_done=0)
    # 8 held and 5 done/s by the one worker; 200 waiting: far more than one worker can clear
    d = tr.step(1.0, waiting=200, in_flight=8, per_worker_done=5)
    assert d.reason == "up" and d.start == 4  # up_min_step, not all at once
    assert d.desired == 10  # the gauge says where it is heading (the max)
    tr.arrive()
    d = tr.step(1.0, waiting=200, in_flight=40, per_worker_done=5)
    assert d.reason == "up-cooldown" and d.start == 0 and d.desired == 10
    d = tr.step(10.0, waiting=200, in_flight=40, per_worker_done=50)
    assert d.reason == "up" and d.start == 5  # at most doubling; capped by max_workers
    tr.arrive()
    d = tr.step(10.0, waiting=300, in_flight=80, per_worker_done=50)
    assert d.start == 0 and tr.size == 10  # never past max_workers


def test_inside_the_tolerance_band_nothing_changes() -> None:
    tr = Trace(workers=4)
    tr.step(1.0, waiting=0, in_flight=26, per_worker_done=0)
    # 16 done/s with 26 held: 4.9 jobs/s per full worker; 16 arriving/s needs 4.06 workers
    decisions = [tr.step(1.0, waiting=0, in_flight=26, per_worker_done=4) for _ in range(30)]
    assert decisions[-1].need == pytest.approx(4.06, abs=0.01)
    assert all(d.start == 0 and not d.drain for d in decisions)


def test_scale_down_waits_for_the_window_and_cooldown_then_drains_the_least_loaded() -> None:
    cfg = AutoscaleConfig(
        min_workers=1, max_workers=10, up_cooldown_s=1, down_cooldown_s=30, down_window_s=20,
        rate_halflife_s=0.0,
    )  # fmt: skip
    tr = Trace(cfg, workers=3)
    tr.used = {"w0": 3, "w1": 0, "w2": 1}
    tr.policy._last_change = 0.0  # the fleet was just sized
    reasons = []
    for _ in range(29):
        reasons.append(tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0).reason)
    assert set(reasons) == {"down-cooldown"}
    d = tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0)
    assert d.reason == "down" and d.drain == ["w1"]  # holds nothing
    assert d.desired == 1
    # the next drain waits until w1 has left, however long it takes
    for _ in range(50):
        assert tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0).reason == "draining"
    tr.leave("w1")
    d = tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0)
    assert d.reason == "down-cooldown"  # a change resets the cooldown, measured from the drain
    tr.t += 30.0
    d = tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0)
    assert d.reason == "down" and d.drain == ["w2"]
    tr.leave("w2")
    tr.t += 100.0
    d = tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0)
    assert d.reason == "steady" and tr.size == 1  # the warm pool stays


def test_a_short_dip_inside_the_window_does_not_scale_down() -> None:
    cfg = AutoscaleConfig(
        min_workers=1, max_workers=10, down_cooldown_s=0, down_window_s=20, rate_halflife_s=0.0
    )
    tr = Trace(cfg, workers=4)
    for i in range(60):
        busy = i % 15 < 10  # 10 s of load, 5 s of quiet, again
        d = tr.step(1.0, waiting=0, in_flight=28 if busy else 0, per_worker_done=0)
        assert not d.drain, i


def test_scale_to_zero_after_idle_and_back_to_the_warm_pool_at_once() -> None:
    cfg = AutoscaleConfig(
        min_workers=2, max_workers=10, scale_to_zero=True, zero_after_s=60,
        down_cooldown_s=0, down_window_s=5, max_down_step=2, rate_halflife_s=0.0,
    )  # fmt: skip
    tr = Trace(cfg, workers=2)
    for _ in range(59):
        assert tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0).reason == "steady"
    reasons = [tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0) for _ in range(6)]
    down = [d for d in reasons if d.reason == "down"]
    assert len(down) == 1 and len(down[0].drain) == 2
    tr.leave("w0")
    tr.leave("w1")
    assert tr.size == 0
    d = tr.step(1.0, waiting=1, in_flight=0, per_worker_done=0)
    assert d.reason == "up" and d.start == 2  # straight back to the warm pool, no cooldown


def test_without_scale_to_zero_the_warm_pool_stays_and_starts_when_short() -> None:
    tr = Trace(AutoscaleConfig(min_workers=3, max_workers=5), workers=0)
    d = tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0)
    assert d.reason == "up" and d.start == 3
    tr.arrive()
    for _ in range(400):
        assert tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0).reason == "steady"


def test_pick_to_drain_prefers_the_least_loaded() -> None:
    ws = [
        WorkerLoad("a", slots_used=2, jobs_done=5),
        WorkerLoad("b", slots_used=0, jobs_done=9),
        WorkerLoad("c", slots_used=0, jobs_done=1),
    ]
    assert pick_to_drain(ws, 2) == ["c", "b"]


def test_scale_to_zero_ignores_the_tail_of_the_smoothed_arrival_rate() -> None:
    cfg = AutoscaleConfig(
        min_workers=1, max_workers=4, scale_to_zero=True, zero_after_s=30, down_cooldown_s=0,
        down_window_s=5, rate_halflife_s=10.0,
    )  # fmt: skip
    tr = Trace(cfg, workers=1)
    tr.step(1.0, waiting=0, in_flight=2, per_worker_done=0)
    tr.step(1.0, waiting=0, in_flight=2, per_worker_done=5)  # busy: arrivals measured
    decisions = [tr.step(1.0, waiting=0, in_flight=0, per_worker_done=2)]
    decisions += [tr.step(1.0, waiting=0, in_flight=0, per_worker_done=0) for _ in range(40)]
    assert decisions[-1].signals.arrival_rate > 0  # the EMA never quite reaches zero
    assert [d.drain for d in decisions if d.drain] == [["w0"]]
    assert decisions[-1].desired == 0
