"""The worker's I/O: claim → schedule → engine → publish → complete, with leases, cancel, drain.

Every decision about what runs lives in `worker/scheduler.py`; this file only carries out
its plans against the broker and the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec

from tokenyard import heap
from tokenyard.broker.core import Cancellation, Events, LaneCounts, Lease, Leases, Preempted
from tokenyard.broker.policy import beat_period, beating_since, may_reap, pools_served
from tokenyard.broker.tables import Directory, Quotas, WorkerRegistry
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines.base import Engine, EngineRequest, StepOutput
from tokenyard.engines.models import parse_loras, served_names
from tokenyard.errors import (
    BrokerUnavailable,
    EngineClosed,
    EngineError,
    InvalidRequest,
    UserError,
)
from tokenyard.logs import job_fields
from tokenyard.messages import (
    AdapterRecord,
    FinishReason,
    JobEvent,
    JobResult,
    JobSpec,
    JobStatus,
    ModelLimits,
    Priority,
    TokenChunk,
    WorkerInfo,
)
from tokenyard.metrics import WorkerMetrics, accelerator_utilization
from tokenyard.tracing import JobSpans
from tokenyard.tracing import enabled as tracing_enabled
from tokenyard.worker.scheduler import (
    Job,
    LaneHunch,
    Occupancy,
    Plan,
    Running,
    Scheduler,
    Update,
    moving_average,
    preemptible_lanes,
    preemption_victims,
)
from tokenyard.worker.stats import StatsLine

log = logging.getLogger(__name__)
stats_log = logging.getLogger("tokenyard.worker.stats")
_QUOTA_SWEEP_S = 2.0  # how soon a reservation of an expired job is released at the latest

_STATUS_OF = {
    FinishReason.STOP: JobStatus.SUCCEEDED,
    FinishReason.LENGTH: JobStatus.SUCCEEDED,
    FinishReason.CANCELLED: JobStatus.CANCELLED,
    FinishReason.EXPIRED: JobStatus.EXPIRED,
}

# Cancellation is polled once per engine step, but no more often than this: a tiny model steps
# every few milliseconds, and a round trip per step would cost as much as the step.
CANCEL_POLL_S = 0.02
# Tokenizing a long text prompt (from a producer that sent no token ids) would stall the loop.
_INLINE_CHARS = 4096
_BATCH_FULL_BLOCK_S = 0.02  # a claim's wait while the batch share is held
_PREEMPTED_KEPT = 10_000  # jobs whose preemptions by this worker it remembers
# Writes kept while the broker does not answer (events, completions, retries), at most this many
# items: past it they are given up and their jobs come back by lease, as a crash would leave them.
MAX_UNSENT = 100_000
_RESEND_S = (0.05, 0.5)  # first and longest wait between tries to send kept writes
_SHORT_PAUSE_S = 0.1  # a periodic task's pause this short is a plain sleep, not a wait on stop

Finishing = tuple[Job[Lease], FinishReason, TokenChunk | None]


def consumer_name(started_at: float) -> str:
    """host:pid:start — unique per process start, so a restarted worker is a new consumer."""
    return f"{socket.gethostname()}:{os.getpid()}:{int(started_at * 1000)}"


def worker_limits(engine: Engine, settings: WorkerSettings) -> ModelLimits:
    """The engine's real capacity, narrowed by the settings where they ask for less."""
    own = engine.limits()
    return msgspec.structs.replace(
        own,
        max_seqs=min(n for n in (settings.max_seqs, own.max_seqs) if n),
        token_budget=min(n for n in (settings.token_budget, own.token_budget) if n),
        revision=settings.model_revision or own.revision,
    )


def adapter_records(loras: Sequence[str], model: str, now: float) -> list[AdapterRecord]:
    """`--lora NAME=PATH` entries as the directory keeps them; a local path is made absolute,
    so another worker of the model on this machine can load it from a job's path too."""
    records = []
    for name, path in parse_loras(loras).items():
        where = Path(path).expanduser()
        found = str(where.resolve()) if where.exists() else path  # else: a hub id
        records.append(AdapterRecord(name=name, base=model, path=found, created_at=now))
    return records


class WorkerQueue(Leases, Events, Cancellation, LaneCounts, Protocol):
    """The queue-core roles a worker uses: leases, its jobs' events, cancel requests, and the
    lanes' depths (a full worker looks for higher-priority work waiting: preemption)."""

    settings: BrokerSettings


class WorkerBackend(Protocol):
    """What a worker needs of a backend: the queue, the worker registry, quota sweeps, and
    the directory its LoRA adapters are announced in."""

    @property
    def directory(self) -> Directory: ...

    @property
    def queue(self) -> WorkerQueue: ...

    @property
    def registry(self) -> WorkerRegistry: ...

    @property
    def quotas(self) -> Quotas: ...


class Worker:
    """Serves one model from its lanes through one engine."""

    def __init__(
        self,
        backend: WorkerBackend,
        engine: Engine,
        settings: WorkerSettings,
        consumer: str | None = None,
        metrics: WorkerMetrics | None = None,
        *,
        freeze_heap: bool = False,
    ) -> None:
        self.queue = backend.queue
        self.backend = backend
        self.registry = backend.registry
        self.quotas = backend.quotas
        self.freeze_heap = freeze_heap
        self.engine = engine
        self.settings = settings
        self.model = served_names(settings.model, settings.served_model_name)[0]  # its lanes
        self.started_at = time.time()
        self.consumer = consumer or consumer_name(self.started_at)
        self.limits = worker_limits(engine, settings)  # final once the engine has started
        self.pools = self._pools()
        self.scheduler: Scheduler[Lease] = self._scheduler()
        self._draining = asyncio.Event()
        self._stopping = asyncio.Event()
        self._capacity_freed = asyncio.Event()
        self._slots_full = asyncio.Event()  # every slot taken: the look-out's cue (and stop's)
        self._jobs_done = 0
        self._occupancy = Occupancy(time.monotonic())
        self._tokens_seen = 0
        self._rate_mark = (time.monotonic(), 0)
        self._tokens_per_s = 0.0
        self._stats_line = StatsLine(self.consumer, settings.log_stats_s, time.monotonic())
        self._cancel_checked_at = 0.0
        self._beating_since: float | None = None  # since when every beat went through
        self._beat_covers: float | None = None  # until when the last beat's liveness runs
        # steps' broker writes not sent yet, oldest first (see `_publish`)
        self._unsent: deque[_Writes] = deque()
        self._publishing = asyncio.Lock()
        self._resending: asyncio.Task[None] | None = None
        self._dropped_runs: set[str] = set()  # jobs whose dropped run's end is still to come
        self._preemptible = preemptible_lanes(settings.preempt_lanes)
        # chosen for preemption by the look-out (see `_preempt_loop`), carried out by the
        # output loop between steps, where every token it folded in is written already
        self._preempting: set[str] = set()
        self._prefill_cap: int | None = None  # the step prefill cap the engine was last told
        self._hand_back: set[str] = set()  # reserve jobs to hand back with them
        self._lane_hunch = LaneHunch()  # preemptions for lane work no claim brought yet
        self._spared: set[tuple[str, str]] = set()  # (job, entry) the broker would not preempt
        # how often this worker preempted each job (the latest _PREEMPTED_KEPT): one at the
        # bound is not tried again, so it never leaves the engine only to be refused
        self._preempted: OrderedDict[str, int] = OrderedDict()
        self.metrics = metrics if metrics is not None else WorkerMetrics(self.model)
        # None when tracing is off: each hook below is then one test
        self.spans = JobSpans(self.consumer) if tracing_enabled() else None

    def _pools(self) -> list[int]:
        """The size pools this worker claims from: those its context holds, its own first."""
        return pools_served(self.limits.context, self.queue.settings.pool_bounds)

    def _scheduler(self) -> Scheduler[Lease]:
        claim_ahead = self.settings.claim_ahead
        if claim_ahead is None:
            claim_ahead = max(1, self.limits.max_seqs // 8)
        return Scheduler(
            self.limits,
            claim_ahead,
            self.settings.batch_share,
            self.settings.alone_step_every,
            self.settings.prefill_cap_tokens,
            self.settings.prefill_cap_window_s,
        )

    def _cap_prefill(self) -> None:
        """Tell the engine the scheduler's step prefill cap when it changes (on the clock of
        `Job.claimed_at`): after a claim is offered, and after each delivery, where the
        window's end is met while anything runs."""
        cap = self.scheduler.step_prefill_cap(time.time())
        if cap != self._prefill_cap:
            self._prefill_cap = cap
            self.engine.cap_prefill(cap)

    async def _announce_adapters(self) -> None:
        """Put this worker's `--lora` adapters in the broker's directory, under its model:
        every gateway then routes their names here."""
        for record in adapter_records(self.settings.loras, self.model, time.time()):
            await self.backend.directory.put_adapter(record)

    # -- lifecycle -------------------------------------------------------------------------
    def drain(self) -> None:
        """Stop claiming; in-flight work finishes or is handed back. Safe from a signal handler."""
        self._draining.set()

    @property
    def busy(self) -> int:
        return self.scheduler.running + self.scheduler.waiting

    async def run(self) -> None:
        """Serve until drain() is called, then finish or release in-flight work and return."""
        await self.engine.start()
        # an engine on a GPU sizes its KV cache from the memory left once its weights are in
        self.limits = worker_limits(self.engine, self.settings)
        self.pools = self._pools()
        self.scheduler = self._scheduler()
        if self.freeze_heap:  # the engine's model is in: it stays out of every collection
            heap.freeze()
        self._stats_line = StatsLine(self.consumer, self.settings.log_stats_s, time.monotonic())
        # limits before adapters: a gateway that lists an adapter finds a worker that runs one
        await self._heartbeat()
        await self._announce_adapters()
        await self._beat()  # before any claim: a worker that never beat is never found dead
        log.info(
            "worker %s started: model %s, engine %s, %d slots",
            self.consumer,
            self.model,
            self.engine.name,
            self.limits.max_seqs,
        )
        outputs = asyncio.create_task(self._output_loop(), name="outputs")
        upkeep = asyncio.create_task(self._upkeep_loop(), name="upkeep")
        liveness = asyncio.create_task(self._liveness_loop(), name="liveness")
        lookout = asyncio.create_task(self._preempt_loop(), name="preempt")
        try:
            await self._claim_loop()
            await self._finish_in_flight()
        finally:
            with contextlib.suppress(Exception):  # best effort: what is not sent comes back
                await self._publish()  # by lease
            await self._release_leftovers()
            # both loops end on their own: a cancel landing inside a redis-py call can be
            # swallowed, so neither is cancelled halfway through a broker write
            self._stopping.set()
            self._slots_full.set()  # the look-out's wait ends too
            await self.engine.stop()  # the output loop ends with EngineClosed
            loops = {outputs, upkeep, liveness, lookout}
            if self._resending is not None:  # it ends at its next try, as the loops do
                loops.add(self._resending)
            _, pending = await asyncio.wait(loops, timeout=30.0)
            for task in pending:
                log.error("%s did not stop; cancelling it", task.get_name())
                task.cancel()
            # best effort on the way out: the registry entry expires with its heartbeat anyway
            with contextlib.suppress(Exception):
                await self.registry.deregister(self.model, self.consumer)

    async def _claim_loop(self) -> None:
        while not self._draining.is_set():
            await self._settle(self._start_fitting())  # room a dropped job left
            want = self.scheduler.want()
            batch_room = self.scheduler.batch_room()
            if want == 0 and self._preemptible and self._may_claim_over():
                want, batch_room = 1, 0  # only work that outranks the batch lane answers it
            elif want == 0:
                await self._wait_for_capacity(self.settings.claim_block_s)
                continue
            # The batch lane is closed to this claim, so its wait would not wake when one of our
            # batch jobs ends: wait briefly (new interactive work still wakes it at once).
            block_s = self.settings.claim_block_s
            if batch_room == 0:
                block_s = min(block_s, _BATCH_FULL_BLOCK_S)
            claim_start = time.time()
            try:
                leases = await self.queue.claim(
                    self.model,
                    self.consumer,
                    want,
                    block_s=block_s,
                    pools=self.pools,
                    batch_room=batch_room,
                )
            except Exception:
                # any broker failure (unreachable, a failover's READONLY, a script error) is
                # outlived: this worker claims again, and what was claimed comes back by lease
                log.exception("claim failed; retrying")
                await asyncio.sleep(0.5)
                continue
            if self._preemptible:
                self._lane_hunch.claimed(
                    [lease.spec.priority for lease in leases], time.monotonic()
                )
            if not leases:
                continue
            if self.scheduler.running or self.scheduler.waiting:
                held = {job.job_id for job in self.scheduler.jobs()}
                for lease in leases:
                    if lease.spec.id in held:
                        # a job of ours delivered again (reaped while the broker was out of
                        # reach): the run under its old lease is over, that lease being gone
                        self._drop(lease.spec.id, "delivered again", under=None)
            self.metrics.claims.inc(len(leases))
            claimed_at = time.time()
            self.metrics.claim_wait.observe_all(
                max(0.0, claimed_at - lease.spec.created_at)
                for lease in leases
                if lease.spec.attempt == 0  # a redelivery's created_at is its first enqueue
            )
            self.metrics.affinity_claims.inc(sum(lease.affinity for lease in leases))
            if self.spans is not None:
                self.spans.claimed([lease.spec for lease in leases], claim_start, time.time())
            # prepared concurrently when some must read (an earlier delivery's tokens, a long
            # prompt to tokenize), compile (a structured output) or load (a LoRA adapter); most
            # need none of that, and a task each would cost more than them
            if any(_needs_preparing(lease) for lease in leases):
                jobs = await asyncio.gather(*(self._prepare(lease) for lease in leases))
            else:
                jobs = [await self._prepare_now(lease) for lease in leases]
            for job in jobs:
                if job is not None:
                    self.scheduler.offer(job)
            self._cap_prefill()
            await self._settle(self._start_fitting())
            if self._preemptible:
                # claimed work that outranks what runs preempts it now
                self._mark_victims([job.priority for job in self.scheduler.waiting_jobs()])
                if self._preempting:
                    await self._preempt()

    async def _wait_for_capacity(self, wait_s: float) -> None:
        self._capacity_freed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._capacity_freed.wait(), wait_s)

    async def _finish_in_flight(self) -> None:
        reserve = self.scheduler.take_waiting()
        if reserve:  # not started: another worker can begin them now, not after our drain
            await self.queue.release([job.handle for job in reserve])
        give_up = time.monotonic() + self.settings.drain_timeout_s
        while self.busy and time.monotonic() < give_up:
            await self._wait_for_capacity(0.1)

    async def _release_leftovers(self) -> None:
        leftovers = self.scheduler.drain()
        for job in leftovers:
            self.engine.abort(job.job_id)
        if leftovers:
            # tokens already streamed stay in the event stream; the next worker resumes there
            released = await self.queue.release([job.handle for job in leftovers])
            log.info("released %d of %d unfinished jobs", released, len(leftovers))

    # -- preparing claimed jobs ------------------------------------------------------------
    async def _prepare(self, lease: Lease) -> Job[Lease] | None:
        """A claimed job with its prompt ids and any tokens an earlier delivery streamed."""
        spec = lease.spec
        job: Job[Lease] | None
        if _long_text(spec):
            encode = self.engine.tokenizer.encode
            try:
                prompt_ids = await asyncio.to_thread(encode, spec.prompt or "")
            except Exception as exc:  # tokenizers share no error class: any failure is the prompt's
                await self._untokenized(lease, exc)
                return None
            job = self._fresh(lease, prompt_ids)
        else:
            job = await self._prepare_now(lease)
        if job is None:
            return None
        if lease.resumable:
            try:
                await self._load_resumed_tokens(job)
            except Exception:
                # any broker failure: the lease runs out and the job is redelivered; this
                # worker goes on
                log.exception(
                    "reading %s's earlier tokens failed",
                    spec.id,
                    extra=job_fields(spec.id, spec.trace_context),
                )
                return None
        if spec.sampling.guide is not None or spec.adapter:
            # compiled / loaded off this loop now, so that `add` (on it) finds it done; never
            # raises
            await self.engine.ready_for(spec.sampling, spec.adapter or None, spec.adapter_path)
        return job

    async def _prepare_now(self, lease: Lease) -> Job[Lease] | None:
        """A claimed job whose prompt is ids, or a text short enough to tokenize on this loop
        (a producer that sent text; the gateway always sends ids)."""
        prompt_ids = lease.spec.prompt_token_ids
        if prompt_ids is None:
            try:
                prompt_ids = self.engine.tokenizer.encode(lease.spec.prompt or "")
            except Exception as exc:  # tokenizers share no error class: any failure is the prompt's
                await self._untokenized(lease, exc)
                return None
        return self._fresh(lease, prompt_ids)

    async def _untokenized(self, lease: Lease, exc: Exception) -> None:
        failure = _failure(f"cannot tokenize the prompt: {exc}")
        await self._settle(_Outcome(results=[(lease, failure)]))

    @staticmethod
    def _fresh(lease: Lease, prompt_ids: list[int]) -> Job[Lease]:
        spec = lease.spec
        return Job(
            spec.id,
            lease,
            list(prompt_ids),
            spec.sampling,
            time.time(),
            priority=spec.priority,
            input_lengths=spec.input_lengths,
            pooling=spec.pooling,
        )

    async def _load_resumed_tokens(self, job: Job[Lease]) -> None:
        after = "0"
        while True:
            events = await self.queue.read_events(job.job_id, after=after)
            if not events:
                return
            for event_id, event in events:
                after = event_id
                if isinstance(event, TokenChunk):
                    job.extend(event.token_ids, event.text, event.logprobs)
                    job.durable_tokens, job.durable_chars = len(job.token_ids), len(job.text)

    # -- scheduling ------------------------------------------------------------------------
    def _start_fitting(self) -> _Outcome:
        """Start what the scheduler says fits, at once; the broker writes come after."""
        outcome = _Outcome()
        if self._draining.is_set():
            return outcome  # nothing new starts; the reserve is handed back
        while plan := self.scheduler.schedule():
            self._carry_out(plan, outcome)
            if not outcome.freed:
                break
            outcome.freed = False  # a job that could not start left room: schedule again
        self._occupied()
        return outcome

    def _occupied(self) -> float:
        """Slot-seconds held so far; called whenever the running count may have changed."""
        if self._every_slot_taken:
            self._slots_full.set()
        return self._occupancy.level(self.scheduler.running, time.monotonic())

    @property
    def _every_slot_taken(self) -> bool:
        return self.scheduler.running >= self.limits.max_seqs

    def _carry_out(self, plan: Plan[Lease], outcome: _Outcome) -> None:
        to_engine: list[float] = []
        for job, error in plan.refused:
            outcome.results.append((job.handle, _refused(error)))
        for job in plan.done:
            outcome.finishing.append((job, FinishReason.LENGTH, None))
        for job in plan.start:
            spec = job.handle.spec
            request = EngineRequest(
                job.job_id,
                job.prompt_ids,
                job.params,
                tuple(job.token_ids),
                spec.priority,
                job.input_lengths,
                job.pooling,
                spec.adapter or None,
                spec.adapter_path,
                job.job_id in plan.alone,
            )
            try:
                if spec.adapter and not self.engine.runs_adapters:
                    raise InvalidRequest(
                        f"The model '{spec.adapter}' is a LoRA adapter, and engine "
                        f"{self.engine.name} runs none",
                        param="model",
                    )
                self.engine.add(request)
            except (UserError, EngineError) as exc:
                self._not_taken(job, exc, outcome)
                continue
            except Exception as exc:  # a bug met on this one job: it is retried, the worker goes on
                spec = job.handle.spec
                log.exception(
                    "the engine failed on %s",
                    job.job_id,
                    extra=job_fields(spec.id, spec.trace_context),
                )
                self._not_taken(job, exc, outcome)
                continue
            job.added_at = time.monotonic()
            to_engine.append(max(0.0, time.time() - job.claimed_at))
            if self.spans is not None:
                self.spans.started(job.job_id)
        self.metrics.to_engine.observe_all(to_engine)

    def _not_taken(self, job: Job[Lease], exc: Exception, outcome: _Outcome) -> None:
        """A job the engine would not start: refused (UserError) it fails, else it is retried."""
        self.scheduler.remove(job.job_id)
        outcome.freed = True
        if isinstance(exc, UserError):
            outcome.results.append((job.handle, _refused(exc)))
            return
        if isinstance(exc, EngineError):  # stopped, died, out of room: the engine's own word
            spec = job.handle.spec
            log.warning(
                "the engine could not take %s: %s",
                job.job_id,
                exc,
                extra=job_fields(spec.id, spec.trace_context),
            )
        outcome.failed.append((job, f"{type(exc).__name__}: {exc}"))

    async def _settle(self, outcome: _Outcome, update: Update[Lease] | None = None) -> None:
        """Carry out the broker side of a step and of a scheduling pass, fewest round trips."""
        finishing = list(outcome.finishing)
        failed = list(outcome.failed)
        events: list[tuple[Lease, JobEvent]] = []
        if update is not None:
            self._tokens_seen += update.tokens
            # a job nobody streams keeps its tokens until its result (see JobSpec.stream)
            events = [(job.handle, chunk) for job, chunk in update.events if _streamed(job)]
            finishing += update.finished
            failed += update.failed
            outcome.results += [(job.handle, _failure(error)) for job, error in update.refused]
        results = [
            *outcome.results,
            *((job.handle, self._result(job, reason)) for job, reason, _ in finishing),
        ]
        tails: list[TokenChunk | None] = [None] * len(outcome.results)
        tails += [tail if _streamed(job) else None for job, _, tail in finishing]
        times: list[tuple[float | None, float | None]] = [(None, None)] * len(outcome.results)
        times += [(job.first_token_at, job.last_token_at) for job, _, _ in finishing]
        if events or results or failed:
            self._unsent.append(_Writes(events, results, tails, times, failed))
            if not self._resend_pending:  # else they go after the kept ones, from its task
                await self._publish()
        if results or failed:
            self._capacity_freed.set()

    async def _publish(self) -> None:
        """Send the kept writes, oldest first. While the broker does not answer they stay kept
        (bounded by MAX_UNSENT) and a task sends them again as soon as it answers, so the
        jobs' leases hold and nothing waits for one to expire; a lease really lost meanwhile
        fences the kept writes off (they are refused and dropped)."""
        async with self._publishing:
            while self._unsent:
                writes = self._unsent[0]
                try:
                    await self._send(writes)
                except BrokerUnavailable as exc:
                    self._keep(exc)
                    return
                except Exception:
                    self._unsent.popleft()  # not the broker's absence: sending it again is no cure
                    raise
                self._unsent.popleft()

    @property
    def _resend_pending(self) -> bool:
        return self._resending is not None and not self._resending.done()

    def _keep(self, exc: BrokerUnavailable) -> None:
        kept = sum(w.size for w in self._unsent)
        if kept > MAX_UNSENT:
            log.error("the broker is away (%s): giving up %d kept writes", exc, kept)
            for writes in self._unsent:
                for lease in writes.all_leases():
                    self._drop(lease.spec.id, "its writes were given up", under=lease)
            self._unsent.clear()
            return
        if not self._resend_pending:
            log.warning("the broker is away (%s): keeping %d writes to send again", exc, kept)
            self._resending = asyncio.create_task(self._resend(), name="resend")

    async def _resend(self) -> None:
        """Until the kept writes are sent: renew the leases held (theirs included) and send
        them, backing off while the broker does not answer."""
        wait, longest = _RESEND_S
        while self._unsent and not self._stopping.is_set():
            await asyncio.sleep(wait)
            wait = min(longest, wait * 2)
            try:
                await self._renew()
            except BrokerUnavailable:
                continue
            except Exception:
                log.exception("renewing leases failed")
            try:
                await self._publish()
            except Exception:
                log.exception("sending kept writes failed")
        if not self._unsent:
            log.info("the broker answers again: kept writes sent")

    async def _send(self, writes: _Writes) -> None:
        """One step's writes: events, then completions, then retries; each part is cleared
        once the broker took it, so a send cut short resumes where it stopped."""
        if writes.events:
            await self._append(writes.events)
            writes.events = []
        if writes.results:
            results = writes.results
            complete_start = time.time()
            accepted = await self.queue.complete_many(results, writes.tails)
            writes.results = []
            self._jobs_done += sum(accepted)
            self._count_results(results, accepted)
            if self.spans is not None:
                items = [
                    (lease.spec, result, first, last)
                    for (lease, result), (first, last) in zip(results, writes.times, strict=True)
                ]
                self.spans.settled(items, accepted, complete_start, time.time())
        while writes.failed:
            job, error = writes.failed[0]
            if not await self.queue.retry(job.handle, error):
                self.metrics.dead_letters.inc()
            writes.failed.pop(0)
            self.metrics.retries.inc()
            if self.spans is not None:
                self.spans.forget(job.job_id)

    def _count_results(self, results: list[tuple[Lease, JobResult]], accepted: list[bool]) -> None:
        for (_, result), ours in zip(results, accepted, strict=True):
            if ours:
                self.metrics.jobs.labels(self.model, result.status.value).inc()
            else:
                self.metrics.fenced_completions.inc()

    async def _append(self, events: list[tuple[Lease, JobEvent]]) -> None:
        kept = await self.queue.append_events(events)
        for (lease, _), ours in zip(events, kept, strict=True):
            if not ours:
                self._drop(lease.spec.id, "lease lost", under=lease)

    # -- outputs ---------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            busy = self.scheduler.running > 0  # else the wait below includes idle time
            waited = time.monotonic()
            try:
                outputs = await self.engine.outputs()
            except EngineClosed:
                return
            waited = time.monotonic() - waited
            self.metrics.engine_delivered(self.engine.counters(), waited if busy else None)
            if self._dropped_runs:
                outputs = self._not_dropped(outputs)
            now = time.monotonic()
            update = self.scheduler.update(outputs, now)
            self._occupied()
            if self._prefill_cap is not None or self.scheduler.prefill_cap:
                self._cap_prefill()
            self._first_steps(update, now)
            # refill the engine before any broker write, so it never idles on a round trip
            ended = update.finished or update.failed or update.refused
            outcome = self._start_fitting() if ended else _Outcome()
            try:
                await self._settle(outcome, update)
                self.metrics.publish_time.observe(time.monotonic() - now)
                await self._check_cancellations()
            except Exception:
                # a broker failure of any kind must not end the loop: leases expire and the
                # jobs are redelivered
                log.exception("publishing a step failed")
                await asyncio.sleep(0.1)

    def _first_steps(self, update: Update[Lease], now: float) -> None:
        """Time from engine add to first token, for the jobs whose first token came `now`."""
        jobs = [job for job, _ in update.events] + [job for job, _, _ in update.finished]
        waits: list[float] = []
        for job in jobs:
            if job.first_token_at == now and job.added_at is not None:
                waits.append(max(0.0, now - job.added_at))
                job.added_at = None  # once per delivery
        self.metrics.first_step.observe_all(waits)

    # -- preemption ------------------------------------------------------------------------
    async def _preempt_loop(self) -> None:
        """The look-out: while every slot is taken and something preemptible runs, look for
        higher-priority work waiting (this worker's reserve; the broker's lanes, when this
        worker claims no more) and mark victims (`scheduler.preemption_victims`)."""
        if not self._preemptible:
            return
        period = max(0.005, self.settings.preempt_after_s / 2)
        while not self._stopping.is_set():
            if self._lowest_preemptible() is None:
                # a slot is free (or nothing preemptible runs): nothing to look for until the
                # running count changes with every slot taken, not 100 wake-ups a second
                self._slots_full.clear()
                await self._slots_full.wait()
                continue
            if period <= _SHORT_PAUSE_S:
                # a plain sleep (ends within a period of a stop anyway): a wait_for on the stop
                # event 100 times a second cost a task, a timer and a cancel each time, on the
                # loop that the engine's thread shares the GIL with
                await asyncio.sleep(period)
            else:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), period)
            if self._stopping.is_set() or self._draining.is_set() or self._preempting:
                continue
            try:
                await self._look_for_preemption()
                if self._preempting:
                    await self._preempt()
            except Exception:  # a broker failure: the next period looks again
                log.exception("looking for work to preempt for failed")

    def _lowest_preemptible(self) -> Priority | None:
        """The lowest preemptible lane anything runs in, while no slot is free (None: nothing
        may be preempted), from the scheduler's counts: no scan of the running jobs."""
        if not self._every_slot_taken:
            return None
        lanes = [lane for lane in self.scheduler.running_lanes() if lane in self._preemptible]
        return max(lanes, default=None)

    def _may_preempt_for(self, waiting: Sequence[Priority]) -> bool:
        """Whether some waiting lane outranks a preemptible lane that runs: else no victim can
        be found, and the look-out and the claim loop skip building the list of candidates."""
        lowest = self._lowest_preemptible()
        return lowest is not None and bool(waiting) and min(waiting) < lowest

    def _preemptible_running(self) -> list[Running]:
        """What runs that may be preempted (none while a slot is free)."""
        scheduler = self.scheduler
        if not self._every_slot_taken:
            return []
        bound = self.queue.settings.max_preemptions
        return [
            Running(job.job_id, job.priority, job.claimed_at)
            for job in scheduler.running_jobs()
            # embeddings: one step, nothing to resume; spared: the broker refused it once
            if job.input_lengths is None
            and job.priority in self._preemptible
            and (job.job_id, job.handle.entry_id) not in self._spared
            and self._preempted.get(job.job_id, 0) < bound
            and job.handle.preemptions < bound  # by any worker, before this delivery
        ]

    def _outranked(self, running: list[Running]) -> bool:
        """Whether our reserve holds a job that outranks one of these."""
        lowest = max((r.priority for r in running), default=None)
        return lowest is not None and any(
            j.priority < lowest for j in self.scheduler.waiting_jobs()
        )

    def _may_claim_over(self) -> bool:
        """A full worker running preemptible work claims one job more than its reserve, from
        the lanes above the batch lane (a blocking claim: the broker's own wake-up), so
        higher-priority work reaches it at once and preempts without a round trip to ask."""
        if self._draining.is_set() or self.scheduler.waiting > self.scheduler.claim_ahead:
            return False
        if self._lowest_preemptible() is not Priority.BATCH:
            return False  # no batch job runs (or a slot is free): nothing to claim over for
        running = self._preemptible_running()
        return any(r.priority is Priority.BATCH for r in running) and not self._outranked(running)

    def _mark_victims(self, waiting: list[Priority], back: Sequence[str] = ()) -> None:
        if self._draining.is_set() or not self._may_preempt_for(waiting):
            return  # a drain hands back what it does not finish anyway
        running = self._preemptible_running()
        victims = preemption_victims(running, 0, waiting, self._preemptible)
        if victims:
            self._hand_back.update(back)
            self._preempting.update(victims)

    async def _look_for_preemption(self) -> None:
        if self._spared:  # forget the spared runs that ended
            self._spared &= {(job.job_id, job.handle.entry_id) for job in self.scheduler.jobs()}
        if self._lowest_preemptible() is None:
            return  # a slot is free, or nothing preemptible runs
        reserve = self.scheduler.waiting_jobs()
        waiting = [job.priority for job in reserve]
        # Nothing of ours outranks what runs and a claim would take more (its arrivals are
        # weighed as they come, in the claim loop), or the claim loop waits on the lanes above
        # the batch lane already (`_may_claim_over`): the lanes need not be asked. The common
        # case of a full worker, checked without a scan of its running jobs.
        if not self._may_preempt_for(waiting) and (
            self.scheduler.want() > 0 or self._may_claim_over()
        ):
            return
        running = self._preemptible_running()
        if not running:
            return
        if self.scheduler.want() == 0 and not self._outranked(running):
            # nothing of ours outranks what runs, and no claim takes more: ask the lanes that
            # outrank it, of the size pools it serves. A job waiting there past
            # `preempt_after_s` found no worker with a free slot
            lowest = max(r.priority for r in running)
            grace = self.settings.preempt_after_s
            lanes: list[Priority] = []
            above = 0  # lane jobs that outrank what may be preempted
            for lane in await self.queue.waiting(self.model, lowest, self.pools):
                age = lane.oldest_waiting_age_s
                if age is not None and age >= grace:
                    above += lane.waiting
                    # each takes one victim at most: a deep lane lists no more than can run
                    lanes += [lane.priority] * min(lane.waiting, len(running))
            # only a claim can say whether this worker may take that work (a hold for another
            # worker, or another worker took it first): the hunch remembers what it said
            if not self._lane_hunch.may_preempt(above, time.monotonic()):
                return
            waiting += lanes
            # our reserve's lower jobs go back too, or the freed slot would start them
            best = min(waiting)
            back = [job.job_id for job in reserve if job.priority > best]
            self._mark_victims(waiting, back)
            if self._preempting:
                self._lane_hunch.preempted(best, above)
            return
        self._mark_victims(waiting)

    async def _preempt(self) -> None:
        """Preempt the marked jobs: out of the engine and what waits into their slots at
        once (no round trip before the engine has the new work), then handed back
        (queue.preempt) under the publishing lock, so every token folded into a victim
        before it left the engine is written first, or kept unsent and fenced off after
        (never written: the next holder makes it again). The next holder resumes after
        exactly what the client got. A victim the broker would not take back (preempted too
        often, or its lease lost) waits here again and resumes from its tokens."""
        marked, self._preempting = self._preempting, set()
        back_ids, self._hand_back = self._hand_back, set()
        victims = [job for job in self.scheduler.running_jobs() if job.job_id in marked]
        if not victims:
            return
        for job in victims:
            self.scheduler.remove(job.job_id)
            # its outputs up to the abort's end are this run's, never a later one's
            self._dropped_runs.add(job.job_id)
            self.engine.abort(job.job_id)
        back = [job for job in self.scheduler.waiting_jobs() if job.job_id in back_ids]
        for job in back:  # lower than what the lanes hold: the freed slots are not theirs
            self.scheduler.remove(job.job_id)
        started = self._start_fitting()
        # a job nobody streams wrote no token events: its tokens so far go first
        unwritten = [(job, _unwritten(job)) for job in victims if not _streamed(job)]
        unwritten = [(job, chunk) for job, chunk in unwritten if chunk.token_ids]
        try:
            async with self._publishing:
                if unwritten:
                    events = [(job.handle, chunk) for job, chunk in unwritten]
                    for (job, chunk), ours in zip(
                        unwritten, await self.queue.append_events(events), strict=True
                    ):
                        if ours:
                            job.durable_tokens += len(chunk.token_ids)
                            job.durable_chars += len(chunk.text)
                taken = await self.queue.preempt([job.handle for job in victims])
        except Exception:
            log.exception("preempting %d jobs failed; they run on here", len(victims))
            taken = [Preempted.KEPT] * len(victims)
        for job, how in zip(victims, taken, strict=True):
            spec = job.handle.spec
            if not how:  # preempted its maximum number of times (or lost): it runs on
                self._spared.add((job.job_id, job.handle.entry_id))
                self.scheduler.offer(job)  # from its tokens, at the next free slot
                continue
            if how is Preempted.CANCELLED:  # its client left meanwhile: it ended, not preempted
                log.info(
                    "%s was cancelled as it was preempted",
                    job.job_id,
                    extra=job_fields(spec.id, spec.trace_context),
                )
                continue
            self.metrics.preemptions.inc()
            self._preempted[job.job_id] = self._preempted.pop(job.job_id, 0) + 1
            if len(self._preempted) > _PREEMPTED_KEPT:
                self._preempted.popitem(last=False)
            if self.spans is not None:
                self.spans.forget(job.job_id)
            log.info(
                "preempted %s after %d tokens",
                job.job_id,
                len(job.token_ids),
                extra=job_fields(spec.id, spec.trace_context),
            )
        if back:  # never started: a plain release, uncharged and not counted
            await self.queue.release([job.handle for job in back])
        self._occupied()
        await self._settle(started)
        await self._settle(self._start_fitting())  # a victim that runs on, if room is left
        self._capacity_freed.set()

    async def _check_cancellations(self) -> None:
        if self._resend_pending:
            return  # the broker is away: asked again once it answers
        now = time.monotonic()
        if now - self._cancel_checked_at < CANCEL_POLL_S:
            return
        # a job claimed within the poll period is not asked about yet: most short jobs end
        # before their first poll, and a cancel waits at most one period longer
        settled = time.time() - CANCEL_POLL_S
        held = [job.job_id for job in self.scheduler.jobs() if job.claimed_at <= settled]
        if not held:
            return
        self._cancel_checked_at = now
        not_started: list[Finishing] = []
        for job_id in await self.queue.cancelled(self.model, held):
            if self.scheduler.get(job_id) is not None:
                # the engine answers with a CANCELLED output, which completes the job
                self.engine.abort(job_id)
            elif (job := self.scheduler.remove(job_id)) is not None:
                not_started.append((job, FinishReason.CANCELLED, None))
        if not_started:
            await self._settle(_Outcome(finishing=not_started))

    def _result(self, job: Job[Lease], reason: FinishReason) -> JobResult:
        return JobResult(
            status=_STATUS_OF.get(reason, JobStatus.FAILED),
            finish_reason=reason,
            text=job.text,
            token_ids=job.token_ids,
            prompt_tokens=len(job.prompt_ids),
            completion_tokens=len(job.token_ids),
            worker=self.consumer,
            queued_s=max(0.0, job.claimed_at - job.handle.spec.created_at),
            attempt=job.handle.spec.attempt,
            decode_s=job.decode_s,
            embeddings=job.embeddings,
            logprobs=job.logprobs,
            cached_tokens=job.cached_tokens,
            prompt_logprobs=job.prompt_logprobs,
        )

    def _drop(self, job_id: str, why: str, *, under: Lease | None) -> None:
        """Stop the job's run held `under` that lease (None: whichever this worker holds)."""
        held = next((job for job in self.scheduler.jobs() if job.job_id == job_id), None)
        if held is None or (under is not None and held.handle is not under):
            return  # not held, or held under a newer delivery than the lease that was lost
        in_engine = self.scheduler.get(job_id) is not None
        self.scheduler.remove(job_id)
        self._occupied()
        log.warning("dropping %s: %s", job_id, why, extra=job_fields(job_id))
        self.metrics.leases_lost.inc()
        if self.spans is not None:
            self.spans.forget(job_id)
        if in_engine:
            # its outputs up to its end (the abort's CANCELLED, or an end already on its way)
            # are the dropped run's: a later delivery of the same job here must not get them
            self._dropped_runs.add(job_id)
        self.engine.abort(job_id)
        self._capacity_freed.set()

    def _not_dropped(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """`outputs` less those of dropped runs (see `_drop`); the engine delivers in order,
        so a run's end comes before anything of a new run of the same job."""
        kept = []
        for out in outputs:
            if out.seq_id in self._dropped_runs:
                if out.finish_reason is not None:
                    self._dropped_runs.discard(out.seq_id)
                continue
            kept.append(out)
        return kept

    # -- upkeep ----------------------------------------------------------------------------
    async def _upkeep_loop(self) -> None:
        lease_s = self.queue.settings.lease_s
        period = max(0.05, min(lease_s / 3, self.settings.heartbeat_s))
        next_sweep = 0.0
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), period)
            if self._stopping.is_set():
                return
            try:
                await self._renew()
                if time.monotonic() >= next_sweep:
                    # quota reservations no terminal path settled (expired at claim, a crash
                    # between a terminal write and its settle): idempotent, any worker may
                    next_sweep = time.monotonic() + _QUOTA_SWEEP_S
                    await self.quotas.settle_finished()
                await self._heartbeat()
            except Exception:
                # a broker failure of any kind must not end upkeep: the next period tries again
                log.exception("upkeep failed; retrying")

    async def _liveness_loop(self) -> None:
        """Beat every `beat_period`, and after each beat reap: the jobs of workers whose
        liveness lapsed each time, those whose lease expired every half lease. A task of its
        own, so nothing slower (renewals, a long reap) holds the next beat back; engine steps
        run off this loop (threads, processes), so a long step does not either."""
        liveness_s = self.queue.settings.liveness_s
        period = beat_period(liveness_s)
        next_expired = 0.0
        reaping: asyncio.Task[None] | None = None
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), period)
            if self._stopping.is_set():
                break
            await self._beat()
            now = time.monotonic()
            idle = reaping is None or reaping.done()
            if idle and may_reap(self._beating_since, now, liveness_s):
                expired = now >= next_expired
                if expired:
                    next_expired = now + self.queue.settings.lease_s / 2
                reaping = asyncio.create_task(self._reap(expired), name="reap")
        if reaping is not None:
            await reaping

    async def _beat(self) -> None:
        sent = time.monotonic()
        try:
            await self.queue.beat(self.model, self.consumer)
        except Exception as exc:  # an outage: upkeep logs its traceback every period already
            self._beating_since = None
            log.warning("beat failed (%s); retrying", exc)
            return
        self._beating_since = beating_since(
            self._beating_since, self._beat_covers, time.monotonic()
        )
        self._beat_covers = sent + self.queue.settings.liveness_s

    async def _reap(self, expired: bool) -> None:
        try:
            report = await self.queue.reap(self.model, expired=expired)
        except Exception:
            log.exception("reap failed; retrying")
            return
        self.metrics.dead_letters.inc(len(report.dead))
        if report.requeued or report.dead:
            log.info("reaped %d, dead-lettered %d", len(report.requeued), len(report.dead))

    async def _renew(self) -> None:
        # jobs the engine still runs, and those whose completion or retry is kept unsent
        held = [job.handle for job in self.scheduler.jobs()]
        held += [lease for writes in self._unsent for lease in writes.leases()]
        renewed = await self.queue.renew(held)
        self.metrics.lease_renewals.inc(sum(renewed))
        for lease, ours in zip(held, renewed, strict=True):
            if not ours:
                # lost, or completed while the renewal was on its way (then it is gone already)
                self._drop(lease.spec.id, "lease lost", under=lease)

    async def _heartbeat(self) -> None:
        now = time.monotonic()
        mark_t, mark_n = self._rate_mark
        if now - mark_t >= 1.0:
            rate = (self._tokens_seen - mark_n) / (now - mark_t)
            self._tokens_per_s = moving_average(self._tokens_per_s, rate, 0.5)
            self._rate_mark = (now, self._tokens_seen)
        stats = self.engine.stats()
        self.metrics.sample(
            self.scheduler.running,
            self.scheduler.waiting,
            self._tokens_per_s,
            stats,
            accelerator_utilization(self.settings.device),
        )
        if self._stats_line.due(now):
            level, line = self._stats_line.take(
                now, stats, self.scheduler.running, self.scheduler.waiting, self._jobs_done
            )
            stats_log.log(level, line)
        info = WorkerInfo(
            consumer=self.consumer,
            model=self.model,
            engine=self.engine.name,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            state="draining" if self._draining.is_set() else "running",
            slots_total=self.limits.max_seqs,
            slots_used=self.scheduler.running,
            tokens_per_s=round(self._tokens_per_s, 2),
            mean_batch=round(stats.mean_batch, 3),
            jobs_done=self._jobs_done,
            busy_s=round(self._occupied(), 3),
            limits=self.limits,
            at=time.time(),
        )
        asked = await self.registry.heartbeat(info, ttl_s=max(3 * self.settings.heartbeat_s, 1.0))
        if asked and not self._draining.is_set():
            log.info("draining: an operator asked (tokenyard drain %s)", self.consumer)
            self.drain()


@dataclass
class _Outcome:
    """Broker writes a scheduling pass left to do."""

    results: list[tuple[Lease, JobResult]] = field(default_factory=list)  # refused: failed now
    finishing: list[Finishing] = field(default_factory=list)
    failed: list[tuple[Job[Lease], str]] = field(default_factory=list)  # engine faults: retried
    freed: bool = False


@dataclass
class _Writes:
    """One step's broker writes, in the order they go: events, completions, retries."""

    events: list[tuple[Lease, JobEvent]]
    results: list[tuple[Lease, JobResult]]
    tails: list[TokenChunk | None]
    times: list[tuple[float | None, float | None]]  # first and last token, for the spans
    failed: list[tuple[Job[Lease], str]]

    @property
    def size(self) -> int:
        return len(self.events) + len(self.results) + len(self.failed)

    def leases(self) -> list[Lease]:
        """Leases of jobs whose last word (completion or retry) is among these writes."""
        return [lease for lease, _ in self.results] + [job.handle for job, _ in self.failed]

    def all_leases(self) -> list[Lease]:
        return [lease for lease, _ in self.events] + self.leases()


def _needs_preparing(lease: Lease) -> bool:
    """Whether a claimed job needs awaiting before it may start (see `Worker._prepare`)."""
    spec = lease.spec
    return (
        lease.resumable or _long_text(spec) or spec.sampling.guide is not None or bool(spec.adapter)
    )


def _long_text(spec: JobSpec) -> bool:
    """A text prompt (a producer's; the gateway sends ids) too long to tokenize on the loop."""
    return spec.prompt_token_ids is None and len(spec.prompt or "") > _INLINE_CHARS


def _unwritten(job: Job[Lease]) -> TokenChunk:
    """A job's tokens past those its events hold (a job nobody streams writes none)."""
    n, chars = job.durable_tokens, job.durable_chars
    logprobs = None if job.logprobs is None else job.logprobs[n:]
    return TokenChunk(token_ids=job.token_ids[n:], text=job.text[chars:], logprobs=logprobs)


def _streamed(job: Job[Lease]) -> bool:
    return job.handle.spec.stream


def _failure(error: str) -> JobResult:
    return JobResult(status=JobStatus.FAILED, finish_reason=FinishReason.ERROR, error=error)


def _refused(error: UserError) -> JobResult:
    code = f"{error.code}: " if error.code else ""
    return _failure(f"{code}{error.message}")
