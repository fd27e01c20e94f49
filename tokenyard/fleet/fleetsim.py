"""A fleet of simulated workers on a virtual clock: the autoscaling policy against a trace.

Workers serve jobs with the sim engine's cost model (prefill a + b·prompt; each decode step
c + d·batch), `slots` at a time, pulled from one FIFO lane as slots free up (as real workers
claim). A started worker serves after `cold_start_s`; a drained one takes nothing new and
leaves when its jobs are done. The same `Autoscaler` as `serve --workers auto` decides, or
the fleet stays at a static size. Pure: no I/O, no wall clock.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field

import msgspec

from tokenyard.fleet.autoscale import AutoscaleConfig, Autoscaler, Observation, WorkerLoad


class CostModel(msgspec.Struct, frozen=True, kw_only=True):
    """The sim engine's defaults (engines/sim.py), per job of fixed size."""

    prefill_base: float = 0.002
    prefill_per_token: float = 2e-5
    decode_base: float = 0.01
    decode_per_seq: float = 5e-4
    prompt_tokens: int = 256
    output_tokens: int = 128

    def service_s(self, batch: int) -> float:
        prefill = self.prefill_base + self.prefill_per_token * self.prompt_tokens
        return prefill + self.output_tokens * (self.decode_base + self.decode_per_seq * batch)


class Phase(msgspec.Struct, frozen=True):
    """`duration_s` of Poisson arrivals at `rate` jobs/s."""

    duration_s: float
    rate: float


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    slots: int = 16  # sequences a worker runs at once
    cold_start_s: float = 20.0  # process start + model load before a new worker claims
    dt: float = 0.25  # the virtual clock's step
    cost: CostModel = CostModel()
    seed: int = 0


def worker_capacity(sim: SimConfig) -> float:
    """Jobs/s one worker completes with every slot busy."""
    return sim.slots / sim.cost.service_s(sim.slots)


def bursty_trace(base_workers: int, peak_workers: int, sim: SimConfig) -> list[Phase]:
    """Quiet at `base_workers`' worth, a ramp, a spike at `peak_workers`' worth, back down."""
    per = worker_capacity(sim) * 0.7  # each worker at 70 % in steady state
    base, peak = base_workers * per, peak_workers * per
    return [
        Phase(300, base),
        Phase(60, (base + peak) / 2),
        Phase(240, peak),
        Phase(60, (base + peak) / 2),
        Phase(540, base),
    ]


@dataclass
class _Worker:
    name: str
    ready_at: float
    slots: int
    used: int = 0
    done: int = 0
    draining: bool = False


@dataclass
class SimResult:
    label: str
    jobs: int
    completed: int
    queue_p50_s: float
    queue_p99_s: float
    queue_max_s: float
    worker_s: float  # worker-seconds paid for, starting and draining included
    peak_workers: int
    series: list[tuple[float, float, int, int, float]] = field(default_factory=list)
    # (t, arrival rate, workers alive, waiting, p99 queue time of jobs started in that second)

    def summary(self) -> dict[str, float | int | str]:
        return {
            "label": self.label,
            "jobs": self.jobs,
            "completed": self.completed,
            "queue_p50_s": round(self.queue_p50_s, 3),
            "queue_p99_s": round(self.queue_p99_s, 3),
            "queue_max_s": round(self.queue_max_s, 3),
            "worker_hours": round(self.worker_s / 3600, 3),
            "peak_workers": self.peak_workers,
        }


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def simulate(
    trace: list[Phase],
    sim: SimConfig,
    *,
    static_workers: int | None = None,
    policy: AutoscaleConfig | None = None,
    label: str = "",
) -> SimResult:
    """Replay `trace` on a fleet of `static_workers`, or one sized by `policy`; drain at the end."""
    if (static_workers is None) == (policy is None):
        raise ValueError("give exactly one of static_workers and policy")
    rng = random.Random(sim.seed)
    t = 0.0
    end = sum(p.duration_s for p in trace)
    waiting: deque[float] = deque()  # arrival times, FIFO
    running: list[tuple[float, int, str]] = []  # (finish time, seq, worker) heap
    workers: dict[str, _Worker] = {}
    free: set[str] = set()  # ready, not draining, with a free slot
    queue_times: list[float] = []
    serial = 0
    seq = 0
    jobs = completed = 0
    worker_s = 0.0
    peak = 0
    series: list[tuple[float, float, int, int, float]] = []
    second_waits: list[float] = []

    def start_worker(ready_at: float) -> None:
        nonlocal serial
        name = f"w{serial:05d}"
        serial += 1
        workers[name] = _Worker(name, ready_at, sim.slots)

    for _ in range(static_workers if static_workers is not None else 0):
        start_worker(0.0)
    scaler = Autoscaler(policy, now=0.0) if policy is not None else None
    if scaler is not None:
        for _ in range(policy.min_workers if policy is not None else 0):
            start_worker(0.0)
    next_tick = 0.0
    phase_end, phases = 0.0, iter(trace)
    rate = 0.0
    while t < end or waiting or running:
        if t >= phase_end and t < end:
            phase = next(phases)
            rate, phase_end = phase.rate, phase_end + phase.duration_s
        if t >= end:
            rate = 0.0
        # arrivals in [t, t + dt): Poisson, spread uniformly over the step
        for _ in range(_poisson(rng, rate * sim.dt)):
            waiting.append(t + rng.random() * sim.dt)
            jobs += 1
        t_next = t + sim.dt
        # completions up to the end of the step free their slots
        while running and running[0][0] <= t_next:
            _, _, name = heapq.heappop(running)
            w = workers[name]
            w.used -= 1
            w.done += 1
            completed += 1
            if not w.draining and w.ready_at <= t_next:
                free.add(name)
        for w in list(workers.values()):
            if w.draining and w.used == 0:
                del workers[w.name]
                free.discard(w.name)
            elif not w.draining and w.ready_at <= t_next and w.used < w.slots:
                free.add(w.name)
        # claims: the oldest job to any free slot, from t_next (nobody starts in the past)
        while waiting and waiting[0] <= t_next and free:
            name = next(iter(free))
            w = workers[name]
            arrived = waiting.popleft()
            w.used += 1
            if w.used >= w.slots:
                free.discard(name)
            wait = max(0.0, t_next - arrived)
            queue_times.append(wait)
            second_waits.append(wait)
            seq += 1
            heapq.heappush(running, (t_next + sim.cost.service_s(w.used), seq, name))
        alive = len(workers)
        worker_s += alive * sim.dt
        peak = max(peak, alive)
        t = t_next
        if t >= next_tick:
            next_tick += policy.tick_s if policy is not None else 1.0
            second_waits.sort()
            series.append((t, rate, alive, len(waiting), _quantile(second_waits, 0.99)))
            second_waits = []
            if scaler is not None:
                obs = Observation(
                    at=t,
                    waiting=len(waiting),
                    in_flight=sum(w.used for w in workers.values()),
                    oldest_age_s=(t - waiting[0]) if waiting else None,
                    workers=[
                        WorkerLoad(
                            w.name,
                            "draining" if w.draining else "running",
                            w.used,
                            w.slots,
                            w.done,
                        )
                        for w in workers.values()
                        if w.ready_at <= t
                    ],
                    starting=sum(1 for w in workers.values() if w.ready_at > t),
                )
                decision = scaler.step(obs)
                for _ in range(decision.start):
                    start_worker(t + sim.cold_start_s)
                for name in decision.drain:
                    workers[name].draining = True
                    free.discard(name)
        if t > end + 3600:  # a fleet that can never clear its queue: stop, report what it did
            break
    queue_times.sort()
    return SimResult(
        label=label or (f"static {static_workers}" if static_workers is not None else "policy"),
        jobs=jobs,
        completed=completed,
        queue_p50_s=_quantile(queue_times, 0.5),
        queue_p99_s=_quantile(queue_times, 0.99),
        queue_max_s=queue_times[-1] if queue_times else 0.0,
        worker_s=worker_s,
        peak_workers=peak,
        series=series,
    )


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson draw: Knuth's method for small means, a rounded normal for large ones."""
    if mean <= 0:
        return 0
    if mean > 30:
        return max(0, round(rng.gauss(mean, math.sqrt(mean))))
    limit, k, p = math.exp(-mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1
