"""Group commit: one client's concurrent single-job enqueues reach the broker in one
`enqueue_many` call per model (on Redis, one script call), so a single-job API under load costs
what `enqueue_many` costs. It knows only `enqueue_many`: any backend's queue can use it.

Jobs of many requests (and tenants) share a call, so one request's failure must stay its own:
each job is encoded before it joins a batch, so what fails a call is the call's (the broker
down), or a full lane, which is retried job by job.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import msgspec

from tokenyard.broker.core import EnqueueResult
from tokenyard.errors import InvalidRequest, QueueFull
from tokenyard.messages import JobSpec, encode

EnqueueMany = Callable[[Sequence[JobSpec]], Awaitable[list[EnqueueResult]]]


class GroupCommit:
    """Coalesces concurrent `enqueue` calls, per model, into calls of `enqueue_many`.

    A job goes at once when no call of its model is in flight, so light load waits for nothing.
    Jobs arriving while a call is in flight go together when it returns, when `max_batch` of
    them wait, or `window_s` after the first of them arrived, whichever comes first. A batch is
    all-or-nothing against each lane's bound, so one refused for a full lane is retried job by
    job: a full lane refuses exactly the jobs bound for it.
    """

    def __init__(self, enqueue_many: EnqueueMany, *, max_batch: int, window_s: float) -> None:
        self._enqueue_many = enqueue_many
        self.max_batch = max(1, max_batch)
        self.window_s = window_s
        self.calls = 0  # enqueue_many calls made, for tests and benchmarks
        self._pending: dict[str, list[tuple[JobSpec, asyncio.Future[EnqueueResult]]]] = defaultdict(
            list
        )
        self._in_flight: dict[str, int] = defaultdict(int)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def enqueue(self, spec: JobSpec) -> EnqueueResult:
        """Enqueue one job with whatever else is waiting. A caller cancelled meanwhile does not
        cancel a batch its job rides in; either way its job may still be added. A job that
        cannot be encoded is refused here (InvalidRequest), before it meets any other."""
        _check_encodable(spec)
        model = spec.model
        if not self._in_flight[model] and not self._pending.get(model):
            # light load: the call goes from the caller's own task (no hop through another);
            # jobs arriving meanwhile pile up behind it as usual
            self._in_flight[model] += 1
            try:
                self.calls += 1
                return (await self._enqueue_many([spec]))[0]
            finally:
                self._in_flight[model] -= 1
                if self._pending.get(model):
                    self._flush(model)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[EnqueueResult] = loop.create_future()
        waiting = self._pending[model]
        waiting.append((spec, done))
        if not self._in_flight[model] or len(waiting) >= self.max_batch:
            self._flush(model)
        elif model not in self._timers:
            self._timers[model] = loop.call_later(self.window_s, self._flush, model)
        return await asyncio.shield(done)

    def _flush(self, model: str) -> None:
        timer = self._timers.pop(model, None)
        if timer is not None:
            timer.cancel()
        waiting = self._pending.pop(model, [])
        for start in range(0, len(waiting), self.max_batch):
            self._in_flight[model] += 1
            self._spawn(self._send(model, waiting[start : start + self.max_batch]))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(
        self, model: str, batch: list[tuple[JobSpec, asyncio.Future[EnqueueResult]]]
    ) -> None:
        try:
            self.calls += 1
            results = await self._enqueue_many([spec for spec, _ in batch])
            for (_, done), result in zip(batch, results, strict=True):
                _settle(done, result)
        except QueueFull as full:
            if len(batch) == 1:
                _settle(batch[0][1], full)
            else:
                await self._one_by_one(batch)
        except BaseException as exc:
            # BrokerUnavailable, or shutdown: the call's failure, every caller's (what one job
            # alone fails on, its encoding, `enqueue` checked before the job joined the batch)
            for _, done in batch:
                _settle(done, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._in_flight[model] -= 1
            if self._pending.get(model):
                self._flush(model)  # the group commit point: what piled up goes now

    async def _one_by_one(self, batch: list[tuple[JobSpec, asyncio.Future[EnqueueResult]]]) -> None:
        self.calls += len(batch)

        async def alone(spec: JobSpec) -> EnqueueResult:
            return (await self._enqueue_many([spec]))[0]

        outcomes = await asyncio.gather(*(alone(s) for s, _ in batch), return_exceptions=True)
        for (_, done), outcome in zip(batch, outcomes, strict=True):
            _settle(done, outcome)

    async def close(self) -> None:
        """Send what waits and let calls in flight finish (their callers wait for them)."""
        for model in list(self._pending):
            self._flush(model)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _check_encodable(spec: JobSpec) -> None:
    # Backends encode a batch's jobs together, so a job that cannot be encoded (an int past 64
    # bits, say) would fail every job in its batch; it fails alone, in its caller's task.
    try:
        encode(spec)
    except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:
        raise InvalidRequest(
            f"The job cannot be encoded for the queue: {exc}", code="invalid_value"
        ) from exc


def _settle(done: asyncio.Future[EnqueueResult], outcome: EnqueueResult | BaseException) -> None:
    if done.done():
        return
    if isinstance(outcome, asyncio.CancelledError):
        done.cancel()
    elif isinstance(outcome, BaseException):
        done.set_exception(outcome)
        # a caller that left no longer awaits it; mark it retrieved so asyncio does not warn
        with contextlib.suppress(BaseException):
            done.exception()
    else:
        done.set_result(outcome)
