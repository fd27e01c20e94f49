"""A live call: a job some caller follows now, whether it waits for the result or streams it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

import anyio

from tokenyard.broker.core import Cancellation, CancelOutcome, EnqueueResult
from tokenyard.errors import BrokerUnavailable, NotFound
from tokenyard.gateway.adapters import answered_model
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.events import Events
from tokenyard.gateway.streaming import (
    KEEPALIVE_FRAME,
    EventStreamResponse,
    Renderer,
    primed,
)
from tokenyard.logs import job_fields
from tokenyard.messages import Finished, JobResult, JobSpec
from tokenyard.metrics import GatewayMetrics

if TYPE_CHECKING:  # state imports this module
    from tokenyard.gateway.state import GatewayState

log = logging.getLogger(__name__)


class JobGone(NotFound):
    """The job's record no longer exists (never did, or its TTL ran out)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"the job {job_id} no longer exists", code="job_gone")


@dataclass
class CallTimer:
    """Latency metrics of one live call, observed as its events arrive at the gateway."""

    metrics: GatewayMetrics
    model: str
    started: float = field(default_factory=time.monotonic)
    # told the job's queue time when it ends (the admission's estimate learns from it)
    queued: Callable[[float | None], None] | None = None
    _last: float | None = None
    # what the call's access line reports (gateway/instrument.py)
    ttft_s: float | None = None
    result: JobResult | None = None

    def tokens(self, count: int) -> None:
        now = time.monotonic()
        if self._last is None:
            self.ttft_s = now - self.started
            self.metrics.time_to_first_token.labels(self.model).observe(self.ttft_s)
        elif count:
            # one engine step may carry several tokens; spread the gap over them, as vLLM does
            gap = (now - self._last) / count
            self.metrics.inter_token_latency.labels(self.model).observe_many(gap, count)
        self._last = now

    def finished(self, result: JobResult) -> None:
        """End-of-call metrics; the result carries its queue time, so no record is read."""
        m, model = self.metrics, self.model
        self.result = result
        e2e = time.monotonic() - self.started
        if self._last is None and result.decode_s is not None and result.completion_tokens:
            # a sync call saw no token events (its job streamed none): its worker timed them
            self.ttft_s = max(0.0, e2e - result.decode_s)
            m.time_to_first_token.labels(model).observe(self.ttft_s)
            gaps = result.completion_tokens - 1
            if gaps:
                m.inter_token_latency.labels(model).observe_many(result.decode_s / gaps, gaps)
        m.e2e_request_latency.labels(model).observe(e2e)
        m.jobs_finished.labels(model, result.status.value).inc()
        m.prompt_tokens.labels(model).inc(result.prompt_tokens)
        m.generation_tokens.labels(model).inc(result.completion_tokens)
        if result.queued_s is not None:
            m.request_queue_time.labels(model).observe(result.queued_s)
        if self.queued is not None:
            # a retried or redelivered job also waited out a backoff or a lease: not the
            # estimate's error
            self.queued(result.queued_s if result.attempt == 0 else None)


class Abandonment:
    """Cancels jobs whose live callers went away, after a grace that lets a stream reconnect.

    Only jobs created or joined by a sync or streaming call are `own`ed; async jobs outlive
    readers. Readers are counted per gateway process, so a reconnect must reach the same
    gateway. A job is left as the followers this gateway holds: the broker cancels it only
    when no other gateway's caller still follows it (collapsing).
    """

    def __init__(self, queue: Cancellation, grace_s: float) -> None:
        self.queue = queue
        self.grace_s = grace_s
        self._owned: dict[str, int] = {}  # job id -> followers this gateway holds
        self._readers: dict[str, int] = {}
        self._timers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[CancelOutcome | None]] = set()

    def own(self, job_id: str) -> None:
        self._owned[job_id] = self._owned.get(job_id, 0) + 1

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
            self._owned.pop(job_id, None)
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
        followers = self._owned.pop(job_id, 1)
        task = asyncio.create_task(self._cancel(job_id, followers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        with anyio.CancelScope(shield=True):
            outcome = await task
        return outcome

    async def _cancel(self, job_id: str, followers: int) -> CancelOutcome | None:
        try:
            outcome = await self.queue.leave(job_id, followers)
        except Exception:
            log.warning(
                "cancelling abandoned job %s failed",
                job_id,
                exc_info=True,
                extra=job_fields(job_id),
            )
            return None
        log.info("client went away: job %s %s", job_id, outcome.value, extra=job_fields(job_id))
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


@dataclass(eq=False)
class LiveCall:
    """One caller following one job: its events, the call's timing, and the job's cancellation
    when the caller leaves. `result` serves a sync caller, `stream` a streaming one."""

    state: GatewayState
    job_id: str
    model: str
    _: KW_ONLY
    timer: CallTimer | None = None
    after: str = "0"
    fresh: bool = False  # just enqueued by this call: it cannot have ended yet
    collapsed: bool = False  # joined an identical job in flight (see gateway/cache.py)
    # called with the job's result when this caller sees it (the response cache)
    on_result: Callable[[JobResult], None] | None = None

    @classmethod
    def following(
        cls, state: GatewayState, spec: JobSpec, entered: EnqueueResult, started: float
    ) -> LiveCall:
        """The call of a caller whose job just entered the queue (or who joined an identical
        one in flight); the job is cancelled if they leave and no other caller follows it."""
        state.abandonment.own(entered.job_id)
        # timed under the name asked: an adapter's calls apart from its base's
        label = answered_model(spec)
        timer = CallTimer(
            state.metrics,
            label,
            started=started,
            queued=functools.partial(state.waits.observed, entered.job_id),
        )
        call = cls(
            state,
            entered.job_id,
            spec.model,
            timer=timer,
            fresh=entered.created,
            collapsed=entered.collapsed,
        )
        if entered.collapsed:
            state.metrics.collapsed.labels(label).inc()
        return call

    def _saw(self, result: JobResult) -> None:
        if self.on_result is not None:
            self.on_result(result)

    async def _events(self, *, tokens: bool) -> AsyncGenerator[Events | None, None]:
        """Batches of events up to the job's Finished event; None after `event_block_s` of
        silence. A follow without `tokens` gets only the Finished event (tokens are timed).

        When the job is already terminal and nothing follows `after`, the caller had seen the
        end (a resume after the last event), so the iteration just stops.
        """
        queue, block_s = self.state.backend.queue, self.state.settings.event_block_s
        after = self.after
        if not self.fresh:
            # a resume or a late reader: the job may have ended long ago, so look before waiting
            events: Events | None = await queue.read_events(self.job_id, after=after)
            if not events:
                events = await self._ended(after)
                if events is None:
                    return
            if events:
                yield self._wanted(events, tokens)
                after = events[-1][0]
                if isinstance(events[-1][1], Finished):
                    return
        on_tokens = None if tokens or self.timer is None else self.timer.tokens
        follow = self.state.events.follow(
            self.job_id, self.model, after, tokens=tokens, on_tokens=on_tokens
        )
        try:
            while True:
                events = await follow.next(block_s)
                if not events:
                    # from what this caller saw, not the follow's cursor: the hub may have read
                    # the end into the inbox just as the wait gave up
                    late = await self._ended(after)
                    if late is None:
                        return
                    if not late:
                        yield None
                        continue
                    events = late
                yield self._wanted(events, tokens)
                after = events[-1][0]
                if isinstance(events[-1][1], Finished):
                    return
        finally:
            self.state.events.leave(follow)

    @staticmethod
    def _wanted(events: Events, tokens: bool) -> Events:
        return events if tokens else [(i, e) for i, e in events if isinstance(e, Finished)]

    async def _ended(self, after: str) -> Events | None:
        """After a silence: [] while the job runs, its last events if it ended meanwhile, None
        if it ended with nothing after `after`; JobGone if its record is gone."""
        queue = self.state.backend.queue
        record = await queue.record(self.job_id)
        if record is None:
            raise JobGone(self.job_id)
        if not record.status.terminal:
            return []
        # its Finished event may have landed between the read and the record
        return await queue.read_events(self.job_id, after=after) or None

    async def _result(self) -> JobResult:
        events = self._events(tokens=False)
        async with contextlib.aclosing(events):
            async for batch in events:
                for _, event in batch or ():
                    if isinstance(event, Finished):
                        if self.timer is not None:
                            self.timer.finished(event.result)
                        self._saw(event.result)
                        return event.result
        record = await self.state.backend.queue.record(self.job_id)
        if record is None or record.result is None:
            raise JobGone(self.job_id)
        return record.result

    async def wait(self) -> JobResult:
        """The job's result, however long it takes: no caller leaves, no job is cancelled
        (a background response's watcher)."""
        return await self._result()

    async def result(self, disconnected: Callable[[], Awaitable[None]]) -> JobResult:
        """Wait for the job's result; if the client leaves or time runs out, cancel the job.

        The wait runs in the caller's own task (a task of its own would cost a hop each way on
        every sync call); the client leaving cancels it, as `asyncio.timeout` does, and only
        that cancellation becomes a 499."""
        abandonment = self.state.abandonment
        abandonment.attach(self.job_id)
        caller = asyncio.current_task()
        assert caller is not None
        settled = left = finished = False

        def on_gone(_: asyncio.Future[None]) -> None:
            nonlocal left
            if not settled:
                left = True
                caller.cancel()

        gone = asyncio.ensure_future(disconnected())
        gone.add_done_callback(on_gone)
        limit = asyncio.timeout(self.state.settings.request_timeout_s)
        try:
            async with limit:
                value = await self._result()  # a reader error propagates, and the job is cancelled
            finished = True
            return value
        except TimeoutError:
            if limit.expired():
                raise ApiError(504, "The request timed out", code="timeout") from None
            raise
        except asyncio.CancelledError:
            if left and caller.uncancel() == 0:
                raise ApiError(499, "The client closed the request", code="client_closed") from None
            raise
        finally:
            settled = True
            gone.cancel()
            # no shield here: a cancel it starts runs in a task of its own (cancel_now)
            await abandonment.detach(self.job_id, finished=finished, grace=False)

    async def stream(
        self, renderer: Renderer, headers: dict[str, str], timeout_s: float | None = None
    ) -> EventStreamResponse:
        """An SSE response of the job's events; leaving early detaches (and may cancel) it."""
        return EventStreamResponse(await self.frames(renderer, timeout_s), headers)

    async def frames(
        self, renderer: Renderer, timeout_s: float | None = None
    ) -> AsyncGenerator[bytes, None]:
        """The job's events as SSE frames, already following the job (one of a call's several
        choices, merged by `streaming.merged`); closing it detaches (and may cancel) the job."""
        return await primed(self._frames(renderer, timeout_s))

    async def _frames(
        self, renderer: Renderer, timeout_s: float | None
    ) -> AsyncGenerator[bytes, None]:
        # The first item is an empty priming frame: see `primed`.
        abandonment, job_id, timer = self.state.abandonment, self.job_id, self.timer
        abandonment.attach(job_id)
        finished = False
        give_up = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            yield b""
            if start := renderer.start():
                yield b"".join(start)
            events = self._events(tokens=True)
            async with contextlib.aclosing(events):
                async for batch in events:
                    if give_up is not None and time.monotonic() > give_up:
                        await abandonment.cancel_now(job_id)
                        for f in renderer.failure("the request timed out", "timeout", 504):
                            yield f
                        return
                    if batch is None:
                        yield KEEPALIVE_FRAME
                        continue
                    # one read's events leave in one write: a send per frame costs the
                    # server as much as rendering it
                    frames: list[bytes] = []
                    for event_id, event in batch:
                        if isinstance(event, Finished):
                            finished = True
                            if timer is not None:
                                timer.finished(event.result)
                            self._saw(event.result)
                            frames.extend(renderer.finish(event_id, event.result))
                            break
                        if timer is not None:
                            timer.tokens(len(event.token_ids))
                        frames.extend(renderer.tokens(event_id, event))
                    if frames:
                        yield b"".join(frames)
                    if finished:
                        return
            finished = True
            for f in renderer.ended():
                yield f
        except JobGone:
            finished = True
            for f in renderer.failure("the job no longer exists", "job_gone", 404):
                yield f
        except BrokerUnavailable:
            # the headers are out, so the error can only travel in the stream
            for f in renderer.failure(
                "the job queue is unavailable; reconnect to resume", "broker_unavailable", 503
            ):
                yield f
        except Exception:
            log.exception("event stream of job %s failed", job_id, extra=job_fields(job_id))
            for f in renderer.failure("internal server error", "internal_error", 500):
                yield f
        finally:
            await abandonment.detach(job_id, finished=finished)  # a cancel shields itself
