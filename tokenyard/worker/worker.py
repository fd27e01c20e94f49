"""The worker: claim → admit → engine → publish → complete, with leases, cancel and drain."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenyard.broker.base import Broker, Lease
from tokenyard.config import WorkerSettings
from tokenyard.engines.base import Engine, EngineClosed, StepOutput, validate_request
from tokenyard.messages import (
    FinishReason,
    JobEvent,
    JobResult,
    JobStatus,
    TokenChunk,
    WorkerInfo,
)
from tokenyard.worker.batching import claimable, fits, job_footprint, moving_average

log = logging.getLogger(__name__)

_STATUS_OF = {
    FinishReason.STOP: JobStatus.SUCCEEDED,
    FinishReason.LENGTH: JobStatus.SUCCEEDED,
    FinishReason.CANCELLED: JobStatus.CANCELLED,
    FinishReason.EXPIRED: JobStatus.EXPIRED,
}


# Cancellation is polled once per engine step, but no more often than this: a tiny model steps
# every few milliseconds, and a round trip per step would cost as much as the step.
CANCEL_POLL_S = 0.02


def _merge_per_sequence(outputs: Sequence[StepOutput]) -> list[StepOutput]:
    """Fold the outputs of several engine steps into one per sequence, keeping their order."""
    merged: dict[str, StepOutput] = {}
    for out in outputs:
        seen = merged.get(out.seq_id)
        if seen is None:
            merged[out.seq_id] = StepOutput(
                seq_id=out.seq_id,
                token_ids=list(out.token_ids),
                text=out.text,
                finish_reason=out.finish_reason,
                prompt_tokens=out.prompt_tokens,
                completion_tokens=out.completion_tokens,
                error=out.error,
            )
        elif seen.finish_reason is None:  # nothing follows a finish
            seen.token_ids.extend(out.token_ids)
            seen.text += out.text
            seen.finish_reason = out.finish_reason
            seen.completion_tokens = out.completion_tokens
            seen.error = out.error
    return list(merged.values())


def consumer_name(started_at: float) -> str:
    """host:pid:start — unique per process start, so a restarted worker is a new consumer."""
    return f"{socket.gethostname()}:{os.getpid()}:{int(started_at * 1000)}"


@dataclass
class _Running:
    lease: Lease
    prompt_ids: list[int]
    footprint: int
    claimed_at: float = field(default_factory=time.time)
    token_ids: list[int] = field(default_factory=list)  # includes tokens resumed from a crash
    text: str = ""


class Worker:
    """Serves one model; every decision about how much to take lives in worker/batching.py."""

    def __init__(
        self,
        broker: Broker,
        engine: Engine,
        settings: WorkerSettings,
        consumer: str | None = None,
    ) -> None:
        self.broker = broker
        self.engine = engine
        self.settings = settings
        self.model = settings.model
        self.started_at = time.time()
        self.consumer = consumer or consumer_name(self.started_at)
        self.max_seqs = min(settings.max_seqs, engine.capacity.max_seqs)
        self.token_budget = min(settings.token_budget, engine.capacity.max_tokens)
        self._running: dict[str, _Running] = {}
        self._waiting: deque[_Running] = deque()  # claimed, but over the token budget for now
        self._tokens_in_use = 0
        self._expected_footprint = 0.0
        self._draining = asyncio.Event()
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._jobs_done = 0
        self._tokens_seen = 0
        self._rate_mark = (time.monotonic(), 0)
        self._tokens_per_s = 0.0
        self._cancel_checked_at = 0.0

    # -- lifecycle -------------------------------------------------------------------------
    def drain(self) -> None:
        """Stop claiming; in-flight work finishes or is handed back. Safe from a signal handler."""
        self._draining.set()

    @property
    def busy(self) -> int:
        return len(self._running) + len(self._waiting)

    async def run(self) -> None:
        """Serve until drain() is called, then finish or release in-flight work and return."""
        await self.engine.start()
        await self._heartbeat()
        outputs = asyncio.create_task(self._output_loop(), name="outputs")
        upkeep = asyncio.create_task(self._upkeep_loop(), name="upkeep")
        try:
            await self._claim_loop()
            await self._finish_in_flight()
        finally:
            await self._release_leftovers()
            # both loops end on their own: a cancel landing inside a redis-py call can be
            # swallowed, so neither is cancelled halfway through a broker write
            self._stopping.set()
            await self.engine.stop()  # the output loop ends with EngineClosed
            _, pending = await asyncio.wait({outputs, upkeep}, timeout=30.0)
            for task in pending:
                log.error("%s did not stop; cancelling it", task.get_name())
                task.cancel()
            with contextlib.suppress(Exception):
                await self.broker.deregister(self.model, self.consumer)

    async def _claim_loop(self) -> None:
        while not self._draining.is_set():
            want = claimable(
                self.max_seqs,
                self.token_budget,
                self.busy,
                self._tokens_in_use + sum(r.footprint for r in self._waiting),
                max(1, round(self._expected_footprint)),
            )
            if want == 0:
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), self.settings.claim_block_s)
                continue
            leases = await self.broker.claim(
                self.model, self.consumer, want, block_s=self.settings.claim_block_s
            )
            # admitted concurrently: each may read its event stream to resume a predecessor
            await asyncio.gather(*(self._admit(lease) for lease in leases))

    async def _finish_in_flight(self) -> None:
        give_up = time.monotonic() + self.settings.drain_timeout_s
        while self.busy and time.monotonic() < give_up:
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), 0.1)

    async def _release_leftovers(self) -> None:
        leftovers = [*self._running.values(), *self._waiting]
        self._running.clear()
        self._waiting.clear()
        for run in leftovers:
            self.engine.abort(run.lease.spec.id)
        if leftovers:
            # tokens already streamed stay in the event stream; the next worker resumes there
            released = await self.broker.release([r.lease for r in leftovers])
            log.info("released %d of %d unfinished jobs", released, len(leftovers))

    # -- admission -------------------------------------------------------------------------
    async def _admit(self, lease: Lease) -> None:
        spec = lease.spec
        tokenizer = self.engine.tokenizer
        try:
            prompt_ids = (
                list(spec.prompt_token_ids)
                if spec.prompt_token_ids is not None
                else tokenizer.encode(spec.prompt or "")
            )
        except Exception as exc:  # a prompt the tokenizer rejects is the caller's error
            await self._fail_now(lease, f"cannot tokenize prompt: {exc}")
            return
        try:
            validate_request(spec.id, prompt_ids, spec.sampling, tokenizer.max_model_len)
        except ValueError as exc:
            await self._fail_now(lease, str(exc))
            return
        if len(prompt_ids) + spec.sampling.max_tokens > tokenizer.max_model_len:
            await self._fail_now(
                lease,
                f"prompt ({len(prompt_ids)} tokens) plus max_tokens "
                f"({spec.sampling.max_tokens}) exceeds the context of {tokenizer.max_model_len}",
            )
            return
        run = _Running(lease, prompt_ids, job_footprint(len(prompt_ids), spec.sampling))
        self._expected_footprint = moving_average(self._expected_footprint, run.footprint)
        if lease.resumable:  # an earlier delivery streamed tokens: continue after them
            await self._load_resumed_tokens(run)
        if len(run.token_ids) >= spec.sampling.max_tokens:
            self._running[spec.id] = run  # finished before it started: complete it as it is
            self._tokens_in_use += run.footprint
            await self._complete_many([(run, FinishReason.LENGTH, None)])
            return
        self._waiting.append(run)
        self._start_waiting()

    async def _load_resumed_tokens(self, run: _Running) -> None:
        after = "0"
        while True:
            events = await self.broker.read_events(run.lease.spec.id, after=after)
            if not events:
                return
            for event_id, event in events:
                after = event_id
                if isinstance(event, TokenChunk):
                    run.token_ids.extend(event.token_ids)
                    run.text += event.text

    def _start_waiting(self) -> None:
        while self._waiting and fits(
            self.token_budget, self._tokens_in_use, self._waiting[0].footprint, len(self._running)
        ):
            run = self._waiting.popleft()
            spec = run.lease.spec
            self._running[spec.id] = run
            self._tokens_in_use += run.footprint
            self.engine.add(spec.id, run.prompt_ids, spec.sampling, tuple(run.token_ids))

    # -- outputs ---------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        while True:
            try:
                outputs = await self.engine.outputs()
            except EngineClosed:
                return
            try:
                await self._publish(outputs)
            except Exception:
                # a broker hiccup must not kill the loop; leases expire and jobs are redelivered
                log.exception("publishing a step failed")
                await asyncio.sleep(0.1)

    async def _publish(self, outputs: Sequence[StepOutput]) -> None:
        """One round trip carries every running job's new tokens, one every finished job."""
        events: list[tuple[Lease, JobEvent]] = []
        errors: list[tuple[_Running, str]] = []
        finishing: list[tuple[_Running, FinishReason, TokenChunk | None]] = []
        for out in _merge_per_sequence(outputs):
            run = self._running.get(out.seq_id)
            if run is None:
                continue  # released, lost or aborted by us: nobody is waiting for it here
            chunk = None
            if out.token_ids or out.text:
                run.token_ids.extend(out.token_ids)
                run.text += out.text
                self._tokens_seen += len(out.token_ids)
                chunk = TokenChunk(token_ids=out.token_ids, text=out.text)
            if out.finish_reason is None or out.finish_reason is FinishReason.ERROR:
                if chunk is not None:
                    events.append((run.lease, chunk))
                if out.finish_reason is FinishReason.ERROR:
                    errors.append((run, out.error or "engine error"))
            else:
                # the last tokens travel with the completion: one script instead of two
                finishing.append((run, out.finish_reason, chunk))
        if events:
            kept = await self.broker.append_events(events)
            for (lease, _), ours in zip(events, kept, strict=True):
                if not ours:
                    self._drop(lease.spec.id, "lease lost")
        for run, error in errors:
            if self._forget(run.lease.spec.id):
                await self.broker.retry(run.lease, error)
        await self._complete_many([f for f in finishing if f[0].lease.spec.id in self._running])
        await self._check_cancellations()  # after completing: finished jobs need no check

    async def _check_cancellations(self) -> None:
        now = time.monotonic()
        if not self._running or now - self._cancel_checked_at < CANCEL_POLL_S:
            return
        self._cancel_checked_at = now
        for job_id in await self.broker.cancelled(self.model, list(self._running)):
            # the engine answers with a CANCELLED output, which completes the job
            self.engine.abort(job_id)

    async def _complete_many(
        self, finishing: Sequence[tuple[_Running, FinishReason, TokenChunk | None]]
    ) -> None:
        if not finishing:
            return
        items = []
        for run, reason, _ in finishing:
            self._forget(run.lease.spec.id)
            result = JobResult(
                status=_STATUS_OF.get(reason, JobStatus.FAILED),
                finish_reason=reason,
                text=run.text,
                token_ids=run.token_ids,
                prompt_tokens=len(run.prompt_ids),
                completion_tokens=len(run.token_ids),
                worker=self.consumer,
                queued_s=max(0.0, run.claimed_at - run.lease.spec.created_at),
            )
            items.append((run.lease, result))
        accepted = await self.broker.complete_many(items, [tail for _, _, tail in finishing])
        self._jobs_done += sum(accepted)

    async def _fail_now(self, lease: Lease, error: str) -> None:
        result = JobResult(
            status=JobStatus.FAILED,
            finish_reason=FinishReason.ERROR,
            error=error,
            worker=self.consumer,
        )
        await self.broker.complete(lease, result)
        self._slot_freed.set()

    def _forget(self, job_id: str) -> bool:
        """Free a running job's slot; False if it was not running here."""
        run = self._running.pop(job_id, None)
        if run is not None:
            self._tokens_in_use -= run.footprint
        self._start_waiting()
        self._slot_freed.set()
        return run is not None

    def _drop(self, job_id: str, why: str) -> None:
        log.warning("dropping %s: %s", job_id, why)
        self.engine.abort(job_id)
        self._forget(job_id)

    # -- upkeep ----------------------------------------------------------------------------
    async def _upkeep_loop(self) -> None:
        lease_s = self.broker.settings.lease_s
        period = max(0.05, min(lease_s / 3, self.settings.heartbeat_s))
        next_reap = 0.0
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), period)
            if self._stopping.is_set():
                return
            try:
                await self._renew()
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + lease_s / 2
                    report = await self.broker.reap(self.model)
                    if report.requeued or report.dead:
                        log.info(
                            "reaped %d, dead-lettered %d", len(report.requeued), len(report.dead)
                        )
                await self._heartbeat()
            except Exception:
                log.exception("upkeep failed; retrying")

    async def _renew(self) -> None:
        held = [r.lease for r in (*self._running.values(), *self._waiting)]
        for lease, ours in zip(held, await self.broker.renew(held), strict=True):
            if ours or not self._holds(lease):
                continue  # renewed, or completed while the renewal was on its way
            self._waiting = deque(r for r in self._waiting if r.lease is not lease)
            self._drop(lease.spec.id, "lease lost")

    def _holds(self, lease: Lease) -> bool:
        run = self._running.get(lease.spec.id)
        return (run is not None and run.lease is lease) or any(
            r.lease is lease for r in self._waiting
        )

    async def _heartbeat(self) -> None:
        now = time.monotonic()
        mark_t, mark_n = self._rate_mark
        if now - mark_t >= 1.0:
            rate = (self._tokens_seen - mark_n) / (now - mark_t)
            self._tokens_per_s = moving_average(self._tokens_per_s, rate, 0.5)
            self._rate_mark = (now, self._tokens_seen)
        info = WorkerInfo(
            consumer=self.consumer,
            model=self.model,
            engine=self.engine.name,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self.started_at,
            state="draining" if self._draining.is_set() else "running",
            slots_total=self.max_seqs,
            slots_used=self.busy,
            tokens_per_s=round(self._tokens_per_s, 2),
            mean_batch=round(self.engine.stats().mean_batch, 3),
            jobs_done=self._jobs_done,
            at=time.time(),
        )
        await self.broker.heartbeat(info, ttl_s=max(3 * self.settings.heartbeat_s, 1.0))
