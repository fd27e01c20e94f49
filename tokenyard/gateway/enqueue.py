"""A request's job into the queue: counted, remembered for the dashboard, and cancelled if its
live caller leaves before it is in. Concurrent requests share script calls inside the broker
(group commit, `tokenyard/broker/group_commit.py`)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from tokenyard.broker.core import Cancellation, EnqueueResult, Producer
from tokenyard.errors import QueueFull
from tokenyard.messages import JobSpec
from tokenyard.metrics import GatewayMetrics

log = logging.getLogger(__name__)

RECENT_JOBS = 50
T = TypeVar("T")


class _Queue(Producer, Cancellation, Protocol):
    """Enqueue, and leave a job the caller gave up on."""


class Enqueuer:
    """The gateway's side of enqueueing one job per request."""

    def __init__(self, queue: _Queue, metrics: GatewayMetrics) -> None:
        self.queue = queue
        self.metrics = metrics
        self._tasks: set[asyncio.Task[Any]] = set()
        self.recent: deque[str] = deque(maxlen=RECENT_JOBS)  # ids enqueued, for /dashboard

    async def submit(self, spec: JobSpec, *, live: bool = False) -> EnqueueResult:
        """Enqueue one job; a full lane is counted and re-raised. A `live` job (its caller
        follows it) is cancelled if the caller leaves before the job is in."""
        entering = self._track(self.queue.enqueue(spec))
        try:
            # shielded: a caller that leaves must not cancel the batch its job rides in
            result = await asyncio.shield(entering)
        except QueueFull:
            self.metrics.rejections.labels("queue_full").inc()
            raise
        except asyncio.CancelledError:
            if live:
                entering.add_done_callback(self._orphaned)
            raise
        if result.created:
            self.recent.append(result.job_id)
        return result

    def _orphaned(self, entering: asyncio.Task[EnqueueResult]) -> None:
        if entering.cancelled() or entering.exception() is not None:
            return
        entered = entering.result()
        if entered.created or entered.collapsed:
            self._track(self._cancel(entered.job_id))

    async def _cancel(self, job_id: str) -> None:
        try:
            # as one follower: a collapsed job runs on while other callers follow it
            await self.queue.leave(job_id)
        except Exception:
            log.warning("cancelling job %s of a caller that left failed", job_id, exc_info=True)

    def _track(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        """Let enqueues in flight finish (their callers are waiting for them)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
