"""The one path every call takes: enqueue a job, follow its events, cancel it when abandoned."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

import anyio

from tokenyard.broker.base import Broker, CancelOutcome, EnqueueResult
from tokenyard.errors import QueueFull
from tokenyard.messages import Finished, JobEvent, JobResult, JobSpec
from tokenyard.metrics import GatewayMetrics

log = logging.getLogger(__name__)

KEEPALIVE = None  # yielded by follow() when a wait on the event stream timed out


class JobGone(Exception):
    """The job's record no longer exists (never did, or its TTL ran out)."""


def _honour_cancellation() -> None:
    # On Python 3.11 a cancel that lands as a Redis reply arrives can be swallowed inside the
    # client (asyncio.wait_for's race); re-raise it so a cancelled reader really stops.
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def submit(broker: Broker, metrics: GatewayMetrics, spec: JobSpec) -> EnqueueResult:
    """Enqueue one job; a full lane is counted and re-raised (the caller answers 429)."""
    try:
        return await broker.enqueue(spec)
    except QueueFull:
        metrics.rejections.labels("queue_full").inc()
        raise


class EventReader:
    """Follows job event streams with a bounded number of blocking reads.

    Each blocking read holds a broker connection for up to `block_s`; past `max_blocking`
    concurrent ones, readers poll instead, so many waiting callers cannot exhaust the
    connection pool that enqueue and cancel also need.
    """

    def __init__(
        self, broker: Broker, block_s: float, max_blocking: int, poll_s: float = 0.05
    ) -> None:
        self.broker = broker
        self.block_s = block_s
        self.poll_s = poll_s
        self._blocking = asyncio.Semaphore(max(1, max_blocking))

    async def _wait(self, job_id: str, after: str) -> list[tuple[str, JobEvent]]:
        if self._blocking.locked():
            await asyncio.sleep(self.poll_s)
            return await self.broker.read_events(job_id, after=after)
        async with self._blocking:
            return await self.broker.read_events(job_id, after=after, block_s=self.block_s)

    async def follow(
        self, job_id: str, after: str = "0", fresh: bool = False
    ) -> AsyncGenerator[tuple[str, JobEvent] | None, None]:
        """Events of a job after `after`, ending with its Finished event; None while idle
        (at most once per `block_s`).

        When the job is already terminal and nothing follows `after`, the caller had seen the
        end (a resume after the last event), so the iteration just stops.
        """
        broker = self.broker
        # the first read does not wait, so a finished job is noticed at once; a job the caller
        # has just enqueued cannot have finished, so its first read can wait right away
        first = not fresh
        checked = time.monotonic()
        while True:
            if first:
                events = await broker.read_events(job_id, after=after)
            else:
                events = await self._wait(job_id, after)
            _honour_cancellation()
            now = time.monotonic()
            if not events and (first or now - checked >= self.block_s):
                checked = now
                record = await broker.record(job_id)
                _honour_cancellation()
                if record is None:
                    raise JobGone(job_id)
                if record.status.terminal:
                    # its Finished event may have landed between the read and the record
                    events = await broker.read_events(job_id, after=after)
                    if not events:
                        return
                elif not first:
                    yield KEEPALIVE
            first = False
            for event_id, event in events:
                after = event_id
                yield event_id, event
                if isinstance(event, Finished):
                    return


@dataclass
class CallTimer:
    """Latency metrics of one live call, observed as its events arrive at the gateway."""

    metrics: GatewayMetrics
    model: str
    started: float = field(default_factory=time.monotonic)
    _last: float | None = None

    def tokens(self, count: int) -> None:
        now = time.monotonic()
        if self._last is None:
            self.metrics.time_to_first_token.labels(self.model).observe(now - self.started)
        elif count:
            # one engine step may carry several tokens; spread the gap over them, as vLLM does
            gap = (now - self._last) / count
            histogram = self.metrics.inter_token_latency.labels(self.model)
            for _ in range(count):
                histogram.observe(gap)
        self._last = now

    def finished(self, result: JobResult) -> None:
        """End-of-call metrics; the result carries its queue time, so no record is read."""
        m, model = self.metrics, self.model
        m.e2e_request_latency.labels(model).observe(time.monotonic() - self.started)
        m.jobs_finished.labels(model, result.status.value).inc()
        m.prompt_tokens.labels(model).inc(result.prompt_tokens)
        m.generation_tokens.labels(model).inc(result.completion_tokens)
        if result.queued_s is not None:
            m.request_queue_time.labels(model).observe(result.queued_s)


async def collect(
    reader: EventReader, job_id: str, timer: CallTimer, fresh: bool = False
) -> JobResult:
    """Wait for a job's terminal result, timing its tokens on the way (a sync call)."""
    broker = reader.broker
    events = reader.follow(job_id, fresh=fresh)
    async with contextlib.aclosing(events):
        async for item in events:
            if item is None:
                continue
            _, event = item
            if isinstance(event, Finished):
                timer.finished(event.result)
                return event.result
            timer.tokens(len(event.token_ids))
    record = await broker.record(job_id)
    if record is None or record.result is None:
        raise JobGone(job_id)
    return record.result


class Abandonment:
    """Cancels jobs whose live callers went away, after a grace that lets a stream reconnect.

    Only jobs created by a sync or streaming call are `own`ed; async jobs outlive readers.
    Readers are counted per gateway process, so a reconnect must reach the same gateway.
    """

    def __init__(self, broker: Broker, grace_s: float) -> None:
        self.broker = broker
        self.grace_s = grace_s
        self._owned: set[str] = set()
        self._readers: dict[str, int] = {}
        self._timers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[CancelOutcome | None]] = set()

    def own(self, job_id: str) -> None:
        self._owned.add(job_id)

    def attach(self, job_id: str) -> None:
        self._readers[job_id] = self._readers.get(job_id, 0) + 1
        timer = self._timers.pop(job_id, None)
        if timer is not None:
            timer.cancel()

    async def detach(self, job_id: str, *, finished: bool, grace: bool = True) -> None:
        """A reader left; an owned, unfinished job with no reader left is cancelled."""
        left = self._readers.get(job_id, 1) - 1
        if left > 0:
            self._readers[job_id] = left
            return
        self._readers.pop(job_id, None)
        if finished or job_id not in self._owned:
            self._owned.discard(job_id)
            return
        if grace and self.grace_s > 0:
            self._timers[job_id] = asyncio.create_task(self._cancel_later(job_id))
            return
        await self.cancel_now(job_id)

    async def _cancel_later(self, job_id: str) -> None:
        await asyncio.sleep(self.grace_s)
        self._timers.pop(job_id, None)
        if job_id not in self._readers:
            await self.cancel_now(job_id)

    async def cancel_now(self, job_id: str) -> CancelOutcome | None:
        """Cancel in a task of its own, shielded, so a caller being cancelled cannot stop it."""
        self._owned.discard(job_id)
        task = asyncio.create_task(self._cancel(job_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        with anyio.CancelScope(shield=True):
            outcome = await task
        return outcome

    async def _cancel(self, job_id: str) -> CancelOutcome | None:
        try:
            outcome = await self.broker.cancel(job_id)
        except Exception:
            log.warning("cancelling abandoned job %s failed", job_id, exc_info=True)
            return None
        log.info("client went away: job %s %s", job_id, outcome.value)
        return outcome

    async def close(self) -> None:
        """At shutdown, cancel at once what was waiting out a grace period."""
        timers = list(self._timers.items())
        self._timers.clear()
        for job_id, timer in timers:
            timer.cancel()
            await self.cancel_now(job_id)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
