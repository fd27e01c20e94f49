"""The gateway's queue-wait snapshot: one read per period shared by every request, a stale one
answered at once while the next read runs (a real Valkey, injected clock)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

from tests.conftest import BackendFactory
from tokenyard.broker import new_job_id
from tokenyard.broker.core import LaneBacklog
from tokenyard.gateway.live import CallTimer
from tokenyard.gateway.shedding import QueueWaits
from tokenyard.messages import JobResult, JobSpec, JobStatus, SamplingParams
from tokenyard.metrics import GatewayMetrics

MODEL = "m"


def spec(tenant: str = "acme") -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        tenant=tenant,
        prompt="x",
        sampling=SamplingParams(max_tokens=4),
    )


def staged(lanes: Sequence[LaneBacklog]) -> int:
    """Jobs waiting over the lanes (in the streams or staged)."""
    return sum(lane.queued + sum(t.staged for t in lane.tenants) for lane in lanes)


async def test_reads_are_shared_counted_and_refreshed(make_backend: BackendFactory) -> None:
    broker = make_backend()
    now = [0.0]
    waits = QueueWaits(broker.queue, broker.registry, ttl_s=0.25, clock=lambda: now[0])
    await broker.queue.enqueue_many([spec() for _ in range(3)])
    first, second = await asyncio.gather(waits.of(MODEL), waits.of(MODEL))
    assert first is second and staged(first.lanes) == 3
    assert first.rate is None  # no worker has reported: the caller admits
    # within the period: no read; this gateway's own admissions count at once
    await broker.queue.enqueue_many([spec() for _ in range(2)])
    waits.admitted(spec("other"))
    assert staged((await waits.of(MODEL)).lanes) == 4
    # one to two periods old: answered at once, refreshed behind
    now[0] = 0.3
    assert staged((await waits.of(MODEL)).lanes) == 4
    for _ in range(200):  # let the background read finish (a busy machine: up to 2 s)
        if staged((await waits.of(MODEL)).lanes) == 5:
            break
        await asyncio.sleep(0.01)
    assert staged((await waits.of(MODEL)).lanes) == 5
    # older: the read is awaited
    await broker.queue.enqueue(spec())
    now[0] = 5.0
    assert staged((await waits.of(MODEL)).lanes) == 6


def test_a_followed_calls_queue_time_teaches_the_shortfall(make_backend: BackendFactory) -> None:
    broker = make_backend()
    waits = QueueWaits(broker.queue, broker.registry)
    followed, unfollowed = spec(), spec()
    waits.admitted(followed, 10.0)
    waits.admitted(unfollowed)  # an async job: its outcome is not watched here
    waits.observed(unfollowed.id, 30.0)
    assert waits.shortfall.factor == 1.0
    waits.observed(followed.id, 12.0)
    assert waits.shortfall.factor == 1.2
    waits.observed(followed.id, 50.0)  # reported once
    assert waits.shortfall.factor == 1.2


def test_only_a_first_deliverys_queue_time_is_the_estimates_error(
    make_backend: BackendFactory,
) -> None:
    broker = make_backend()
    waits = QueueWaits(broker.queue, broker.registry)
    first, retried = spec(), spec()
    for job in (first, retried):
        waits.admitted(job, 10.0)
    for job, attempt in ((retried, 1), (first, 0)):
        timer = CallTimer(GatewayMetrics(), MODEL, queued=functools.partial(waits.observed, job.id))
        timer.finished(JobResult(status=JobStatus.SUCCEEDED, queued_s=40.0, attempt=attempt))
        # the retried job's wait (a backoff, a lease) teaches nothing, and is forgotten
        assert waits.shortfall.factor == (1.0 if attempt else 2.0)
