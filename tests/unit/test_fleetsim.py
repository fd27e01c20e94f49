"""The fleet simulation: the policy on a virtual clock against static fleets (small sizes)."""

from __future__ import annotations

import pytest

from tokenyard.fleet.autoscale import AutoscaleConfig
from tokenyard.fleet.fleetsim import Phase, SimConfig, bursty_trace, simulate, worker_capacity

SIM = SimConfig(slots=4, cold_start_s=5.0, dt=0.25)


def policy(**kw: float) -> AutoscaleConfig:
    base: dict[str, float] = dict(
        min_workers=1, max_workers=50, slo_queue_s=2.0, startup_s=SIM.cold_start_s,
        up_cooldown_s=5, down_cooldown_s=10, down_window_s=20, max_down_step=2,
        default_service_rate=worker_capacity(SIM),
    )  # fmt: skip
    base.update(kw)
    return AutoscaleConfig(**base)  # type: ignore[arg-type]


def test_the_policy_follows_a_spike_for_fewer_worker_seconds_than_peak_provisioning() -> None:
    trace = bursty_trace(2, 16, SIM)
    trace = [Phase(p.duration_s / 5, p.rate) for p in trace]  # a short replay
    under = simulate(trace, SIM, static_workers=2)
    peak = simulate(trace, SIM, static_workers=16)
    auto = simulate(trace, SIM, policy=policy())
    assert under.jobs == peak.jobs == auto.jobs > 1000  # one seed, one trace
    assert auto.completed == auto.jobs  # nothing is dropped by scaling down
    assert auto.worker_s < 0.75 * peak.worker_s
    assert auto.queue_p99_s < under.queue_p99_s / 5
    assert peak.queue_p99_s <= SIM.dt
    assert 2 <= auto.series[-1][2] <= 5  # most drained again after the spike
    assert auto.peak_workers >= 12


def test_simulate_takes_one_fleet_kind() -> None:
    with pytest.raises(ValueError):
        simulate([Phase(10, 1.0)], SIM)
