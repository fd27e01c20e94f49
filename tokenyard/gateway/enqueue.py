"""A request's job into the queue: counted, remembered for the dashboard, cancelled if its
live caller leaves before it is in, and its quota reservation given back when no job of its own
holds it. Concurrent requests share script calls inside the broker (group commit,
`tokenyard/broker/group_commit.py`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from tokenyard.broker.core import Cancellation, EnqueueResult, Producer
from tokenyard.broker.tables import Quotas, Settlement
from tokenyard.errors import BrokerUnavailable, QueueFull
from tokenyard.messages import JobSpec
from tokenyard.metrics import GatewayMetrics

log = logging.getLogger(__name__)

RECENT_JOBS = 50
# A refund the broker could not take is tried again this long; past it the quota sweep (which
# releases a reservation with no job record 30 s after it was made) gives it back.
REFUND_RETRY_S = 30.0
_REFUND_BACKOFF_S = (0.05, 0.5)  # first and longest wait between tries
T = TypeVar("T")


class _Queue(Producer, Cancellation, Protocol):
    """Enqueue, and leave a job the caller gave up on."""


class Enqueuer:
    """The gateway's side of enqueueing one job per request."""

    def __init__(self, queue: _Queue, metrics: GatewayMetrics, quotas: Quotas) -> None:
        self.queue = queue
        self.metrics = metrics
        self.quotas = quotas
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self.recent: deque[str] = deque(maxlen=RECENT_JOBS)  # ids enqueued, for /dashboard

    async def submit(self, spec: JobSpec, *, live: bool = False) -> EnqueueResult:
        """Enqueue one job; a full lane is counted and re-raised. A `live` job (its caller
        follows it) is cancelled if the caller leaves before the job is in.

        A reservation (`spec.quota`) whose job this call did not add is refunded on every
        path, once its outcome is known: not created (it joined a job in flight, or its
        idempotency key named one), refused, failed, or its caller gone first. A job that
        landed although its call failed (the connection broke after the script ran) then
        runs unreserved; its own settlement finds nothing held, so nothing is refunded twice."""
        entering = self._track(self.queue.enqueue(spec))
        try:
            # shielded: a caller that leaves must not cancel the batch its job rides in
            result = await asyncio.shield(entering)
        except asyncio.CancelledError:
            entering.add_done_callback(lambda done: self._entered_unfollowed(spec, done, live))
            raise
        except Exception as exc:
            if isinstance(exc, QueueFull):
                self.metrics.rejections.labels("queue_full").inc()
            await self._refunded(spec, request=True)
            raise
        if not result.created:
            # the job it follows (or its key named) holds its own reservation; the request
            # was answered, so it counts
            await self._refunded(spec, request=False)
        else:
            self.recent.append(result.job_id)
        return result

    def _entered_unfollowed(
        self, spec: JobSpec, entering: asyncio.Task[EnqueueResult], live: bool
    ) -> None:
        """The enqueue of a caller who left ended: refund what no job holds, and cancel a
        live caller's job (as one follower: a collapsed job runs on for the others)."""
        entered = None
        if not entering.cancelled() and entering.exception() is None:
            entered = entering.result()
        if entered is None or not entered.created:
            self._track(self._refund(spec, request=entered is None))
        if live and entered is not None and (entered.created or entered.collapsed):
            self._track(self._cancel(entered.job_id))

    async def _refunded(self, spec: JobSpec, *, request: bool) -> None:
        """Refund now, shielded from the caller's own cancel; a broker that does not answer
        leaves it to a task that tries again, so the caller's answer does not wait. `request`:
        the job never entered, so the request is given back too (requests per minute)."""
        if not spec.quota:
            return
        if not await asyncio.shield(self._track(self._refund_once(spec, request))):
            self._track(self._refund(spec, request))

    async def _refund(self, spec: JobSpec, request: bool) -> None:
        """Give back `spec`'s reservation, trying again while the broker does not answer, for
        up to REFUND_RETRY_S (not past the gateway's close)."""
        if not spec.quota:
            return
        give_up = time.monotonic() + REFUND_RETRY_S
        wait, longest = _REFUND_BACKOFF_S
        while not await self._refund_once(spec, request):
            if self._closing or time.monotonic() + wait > give_up:
                log.warning("job %s's reservation is left to the quota sweep", spec.id)
                return
            await asyncio.sleep(wait)
            wait = min(longest, wait * 2)

    async def _refund_once(self, spec: JobSpec, request: bool) -> bool:
        """One try (idempotent per job); False when the broker did not answer."""
        try:
            await self.quotas.settle([Settlement(spec.tenant, spec.id, 0, request)])
        except BrokerUnavailable:
            return False
        except Exception:
            log.exception("refunding job %s's reservation failed", spec.id)
        return True

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
        """Let enqueues in flight finish (their callers are waiting for them), and refunds try
        once more."""
        self._closing = True
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
