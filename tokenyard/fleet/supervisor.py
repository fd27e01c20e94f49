"""The autoscaling loop's I/O: observe a model's lanes and workers, decide, start or drain.

`Supervisor` feeds `autoscale.Autoscaler` from the broker once a tick and exports its
signals as gauges; a `LocalFleet` carries the decisions out as worker processes on this
machine (`tokenyard serve --workers auto`). Without a fleet it only exports the signals
(`tokenyard autoscale`, for KEDA or an HPA to act on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Protocol

from prometheus_client import CollectorRegistry, Gauge

from tokenyard.broker.core import Stats
from tokenyard.broker.tables import WorkerRegistry
from tokenyard.children import spawn_tied
from tokenyard.fleet.autoscale import AutoscaleConfig, Autoscaler, Decision, Observation, WorkerLoad
from tokenyard.messages import WorkerInfo

log = logging.getLogger(__name__)


class FleetSource(Protocol):
    """What the loop reads: lane stats and live workers."""

    @property
    def queue(self) -> Stats: ...

    @property
    def registry(self) -> WorkerRegistry: ...


class AutoscaleMetrics:
    """The policy's output and raw inputs, per model, for external autoscalers and dashboards."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model"], registry=r)

        self.desired = gauge("tokenyard_desired_workers", "Workers the autoscaling policy wants.")
        self.need = gauge(
            "tokenyard_autoscale_need_workers", "Unrounded Little's-law need, before bounds."
        )
        self.current = gauge(
            "tokenyard_autoscale_current_workers", "Live workers not draining, plus starting."
        )
        self.arrival_rate = gauge(
            "tokenyard_autoscale_arrival_rate", "Jobs entering the model's lanes per second."
        )
        self.service_rate = gauge(
            "tokenyard_autoscale_service_rate",
            "Jobs per second one worker completes with all its slots busy (measured).",
        )
        self.waiting = gauge("tokenyard_autoscale_waiting", "Jobs waiting, retries included.")
        self.in_flight = gauge("tokenyard_autoscale_in_flight", "Jobs held by workers.")
        self.oldest_age = gauge(
            "tokenyard_autoscale_oldest_age_seconds", "Age of the oldest waiting job."
        )

    def record(self, model: str, decision: Decision) -> None:
        s = decision.signals
        self.desired.labels(model).set(decision.desired)
        self.need.labels(model).set(decision.need)
        self.current.labels(model).set(s.running + s.starting)
        self.arrival_rate.labels(model).set(s.arrival_rate)
        self.service_rate.labels(model).set(s.service_rate)
        self.waiting.labels(model).set(s.waiting)
        self.in_flight.labels(model).set(s.in_flight)
        self.oldest_age.labels(model).set(s.oldest_age_s)


class LocalFleet:
    """Worker processes on this machine: started by command, drained by SIGTERM."""

    def __init__(
        self,
        command: Callable[[], list[str]],
        drain_timeout_s: float,
        procs: list[subprocess.Popen[bytes]] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.command = command
        self.env = env  # the workers' environment; None: this process's
        self.drain_timeout_s = drain_timeout_s
        self.procs = procs if procs is not None else []  # shared with its owner, for shutdown
        self._drained_at: dict[int, float] = {}
        self._host = socket.gethostname()

    def ours(self, info: WorkerInfo) -> subprocess.Popen[bytes] | None:
        if info.host != self._host:
            return None
        return next((p for p in self.procs if p.pid == info.pid), None)

    def starting(self, live: Sequence[WorkerInfo]) -> int:
        """Processes started and alive that have not sent a heartbeat yet."""
        seen = {info.pid for info in live if info.host == self._host}
        # a drained worker deregisters a moment before it exits: it is leaving, not starting
        return sum(
            1
            for p in self.procs
            if p.poll() is None and p.pid not in seen and p.pid not in self._drained_at
        )

    def start(self, n: int) -> None:
        for _ in range(n):
            # a killed supervisor's workers drain and exit rather than run on unwatched
            proc = spawn_tied(self.command(), signal.SIGTERM, env=self.env)
            log.info("started worker %d", proc.pid)
            self.procs.append(proc)

    def drain(self, info: WorkerInfo) -> bool:
        """SIGTERM: the worker stops claiming, finishes or hands back its jobs, and exits."""
        proc = self.ours(info)
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGTERM)
        self._drained_at[proc.pid] = time.monotonic()
        log.info("draining worker %d (%s)", proc.pid, info.consumer)
        return True

    def reap(self) -> None:
        """Forget exited processes; kill one whose drain overran (its leases are reaped)."""
        now = time.monotonic()
        for proc in list(self.procs):
            code = proc.poll()
            if code is not None:
                if code != 0:
                    log.warning("worker %d exited with %d", proc.pid, code)
                self.procs.remove(proc)
                self._drained_at.pop(proc.pid, None)
                continue
            since = self._drained_at.get(proc.pid)
            if since is not None and now - since > self.drain_timeout_s + 15:
                log.warning("worker %d did not drain in time; killing it", proc.pid)
                proc.kill()


@dataclass(eq=False)
class Supervisor:
    """One model's autoscaling loop."""

    broker: FleetSource
    model: str
    config: AutoscaleConfig
    _: KW_ONLY
    fleet: LocalFleet | None = None
    metrics: AutoscaleMetrics | None = None
    clock: Callable[[], float] = time.monotonic
    policy: Autoscaler = field(init=False)
    decisions: list[Decision] = field(default_factory=list, init=False)  # for tests and logs

    def __post_init__(self) -> None:
        self.policy = Autoscaler(self.config, now=self.clock())

    async def observe(self) -> tuple[Observation, list[WorkerInfo]]:
        stats = await self.broker.queue.stats(self.model)
        infos = await self.broker.registry.workers(self.model)
        ages = [lane.oldest_waiting_age_s for lane in stats.lanes if lane.oldest_waiting_age_s]
        obs = Observation(
            at=self.clock(),
            # a job waiting out a retry backoff is still in the system: keeps the flow balance
            waiting=sum(lane.waiting for lane in stats.lanes) + stats.delayed,
            in_flight=sum(lane.in_flight for lane in stats.lanes),
            oldest_age_s=max(ages, default=None),
            workers=[
                WorkerLoad(
                    info.consumer,
                    state=info.state,
                    slots_used=info.slots_used,
                    slots_total=max(1, info.slots_total),
                    jobs_done=info.jobs_done,
                )
                for info in infos
            ],
            starting=self.fleet.starting(infos) if self.fleet is not None else 0,
        )
        return obs, infos

    async def tick(self) -> Decision:
        if self.fleet is not None:
            self.fleet.reap()
        obs, infos = await self.observe()
        decision = self.policy.step(obs)
        if self.metrics is not None:
            self.metrics.record(self.model, decision)
        if decision.start or decision.drain:
            log.info(
                "%s: %s to %d (need %.2f; λ %.2f/s, μ %.2f/s, waiting %d, oldest %.1fs)",
                self.model, decision.reason, decision.desired, decision.need,
                decision.signals.arrival_rate, decision.signals.service_rate,
                decision.signals.waiting, decision.signals.oldest_age_s,
            )  # fmt: skip
            self.decisions.append(decision)
        if self.fleet is not None:
            self.fleet.start(decision.start)
            by_consumer = {info.consumer: info for info in infos}
            for consumer in decision.drain:
                if not self.fleet.drain(by_consumer[consumer]):
                    # not one of ours (or already gone): the policy must not wait for it
                    self.policy.draining.discard(consumer)
        return decision

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until `stop` is set; a broker error skips a tick, it does not end the loop."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:
                log.exception("autoscaling tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.tick_s)
