"""Group commit: concurrent requests' jobs reach the broker in one enqueue call per model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tokenyard.broker import Broker
from tokenyard.broker.base import EnqueueResult
from tokenyard.errors import QueueFull
from tokenyard.messages import JobSpec
from tokenyard.metrics import GatewayMetrics

log = logging.getLogger(__name__)

RECENT_JOBS = 50


@dataclass
class _Pending:
    spec: JobSpec
    done: asyncio.Future[EnqueueResult]
    live: bool  # a caller follows it: if the caller leaves before the job is in, cancel it


class Enqueuer:
    """Coalesces the enqueues of one gateway, per model.

    A job goes at once when no call of its model is in flight, so light load waits for nothing.
    Jobs arriving while a call is in flight go together when it returns, when `max_batch` of
    them wait, or `window_s` after the first of them arrived, whichever comes first.
    """

    def __init__(
        self,
        broker: Broker,
        metrics: GatewayMetrics,
        *,
        max_batch: int = 64,
        window_s: float = 0.0005,
    ) -> None:
        self.broker = broker
        self.metrics = metrics
        self.max_batch = max(1, max_batch)
        self.window_s = window_s
        self.calls = 0  # enqueue calls made, for tests and benchmarks
        self._pending: dict[str, list[_Pending]] = defaultdict(list)
        self._in_flight: dict[str, int] = defaultdict(int)
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.recent: deque[str] = deque(maxlen=RECENT_JOBS)  # ids enqueued, for /dashboard

    async def submit(self, spec: JobSpec, *, live: bool = False) -> EnqueueResult:
        """Enqueue one job with whatever else is waiting; a full lane is counted and re-raised."""
        loop = asyncio.get_running_loop()
        item = _Pending(spec, loop.create_future(), live)
        model = spec.model
        waiting = self._pending[model]
        waiting.append(item)
        if not self._in_flight[model] or len(waiting) >= self.max_batch:
            self._flush(model)
        elif model not in self._timers:
            self._timers[model] = loop.call_later(self.window_s, self._flush, model)
        try:
            # shielded: a caller that leaves must not cancel the batch its job rides in
            result = await asyncio.shield(item.done)
            if result.created:
                self.recent.append(result.job_id)
            return result
        except QueueFull:
            self.metrics.rejections.labels("queue_full").inc()
            raise
        except asyncio.CancelledError:
            item.done.add_done_callback(self._orphaned(item))
            raise

    def _orphaned(self, item: _Pending) -> Callable[[asyncio.Future[EnqueueResult]], None]:
        def cancel_if_in(done: asyncio.Future[EnqueueResult]) -> None:
            if not item.live or done.cancelled() or done.exception() is not None:
                return
            if done.result().created:
                self._spawn(self._cancel(done.result().job_id))

        return cancel_if_in

    async def _cancel(self, job_id: str) -> None:
        try:
            await self.broker.cancel(job_id)
        except Exception:
            log.warning("cancelling job %s of a caller that left failed", job_id, exc_info=True)

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

    async def _send(self, model: str, batch: list[_Pending]) -> None:
        try:
            self.calls += 1
            results = await self.broker.enqueue_many([p.spec for p in batch])
            for item, result in zip(batch, results, strict=True):
                _settle(item.done, result)
        except QueueFull as full:
            if len(batch) == 1:
                _settle(batch[0].done, full)
            else:
                await self._one_by_one(batch)
        except BaseException as exc:  # BrokerUnavailable, or shutdown: every caller hears it
            for item in batch:
                _settle(item.done, exc)
            if not isinstance(exc, Exception):
                raise
        finally:
            self._in_flight[model] -= 1
            if self._pending.get(model):
                self._flush(model)  # the group commit point: what piled up goes now

    async def _one_by_one(self, batch: list[_Pending]) -> None:
        # A model's batch is all-or-nothing against each lane's bound; alone, each job meets
        # only its own lane's bound, so a full lane refuses exactly the jobs bound for it.
        self.calls += len(batch)
        outcomes = await asyncio.gather(
            *(self.broker.enqueue(p.spec) for p in batch), return_exceptions=True
        )
        for item, outcome in zip(batch, outcomes, strict=True):
            _settle(item.done, outcome)

    async def close(self) -> None:
        """Let calls in flight finish (their callers are waiting for them)."""
        for model in list(self._pending):
            self._flush(model)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


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
