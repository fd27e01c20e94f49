"""Operator actions on a broker: list and requeue dead letters, drain a worker by name.

Shared by the gateway's admin routes and the CLI (`tokenyard dlq`, `tokenyard drain`). A
requeue makes a new job from the dead one's spec, with an id derived from the dead job's: the
dead job stays dead (its record, events and audit entries keep telling what happened), and
asking twice finds the job the first request made.
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Sequence
from typing import Protocol

import msgspec

from tokenyard.broker.core import Clock, Producer, Records, Stats
from tokenyard.broker.ids import is_job_id, tag_of_job
from tokenyard.broker.tables import WorkerRegistry
from tokenyard.messages import DeadLetter, JobStatus

# uuid5 namespace of requeued jobs' ids (any fixed uuid; this one is uuid5(URL, "tokenyard"))
_REQUEUE_NS = uuid.uuid5(uuid.NAMESPACE_URL, "tokenyard/requeue")


class AdminQueue(Producer, Records, Stats, Protocol):
    """The queue roles the operator actions use."""


class RequeueOutcome(enum.StrEnum):
    REQUEUED = "requeued"  # a new job is queued
    ALREADY_REQUEUED = "already_requeued"  # an earlier request made it
    NOT_FOUND = "not_found"  # no record (never existed, or it lapsed)
    NOT_DEAD = "not_dead"  # the job is not a dead letter


class Requeue(msgspec.Struct, frozen=True):
    outcome: RequeueOutcome
    job_id: str
    requeued_as: str | None = None  # the new job's id
    status: JobStatus | None = None  # the job's status when it is not dead


class DeadLetterView(msgspec.Struct, frozen=True):
    """A dead letter and, once requeued, the job that took its place."""

    entry: DeadLetter
    requeued_as: str | None


def requeue_id(job_id: str) -> str:
    """The id a requeue of `job_id` gives its new job: same model tag, a uuid derived from it."""
    return f"{tag_of_job(job_id)}-{uuid.uuid5(_REQUEUE_NS, job_id).hex}"


async def requeue_dead(queue: AdminQueue, job_id: str, clock: Clock = time.time) -> Requeue:
    """Queue a dead job again as a new job of the same spec (tenant, lane, sampling), its
    deadline as far from now as it was from its creation. It takes no quota reservation: an
    operator's requeue is not the tenant's new request."""
    record = await queue.record(job_id) if is_job_id(job_id) else None
    if record is None:
        return Requeue(RequeueOutcome.NOT_FOUND, job_id)
    if record.status is not JobStatus.DEAD:
        return Requeue(RequeueOutcome.NOT_DEAD, job_id, status=record.status)
    new_id = requeue_id(job_id)
    if await queue.record(new_id) is not None:
        return Requeue(RequeueOutcome.ALREADY_REQUEUED, job_id, new_id)
    old, now = record.spec, clock()
    spec = msgspec.structs.replace(
        old,
        id=new_id,
        created_at=now,
        deadline=None if old.deadline is None else now + (old.deadline - old.created_at),
        # two requeues at once make one job (the key is the tenant's, the dead id unique)
        idempotency_key=f"requeue:{job_id}",
        collapse_key=None,
        trace_context={},
        quota=False,
        attempt=0,
    )
    made = await queue.enqueue(spec)
    outcome = RequeueOutcome.REQUEUED if made.created else RequeueOutcome.ALREADY_REQUEUED
    return Requeue(outcome, job_id, made.job_id)


async def dead_letters(queue: AdminQueue, model: str, count: int = 100) -> list[DeadLetterView]:
    """A model's dead letters (the stream's first `count`), each with its requeued job's id
    when it was requeued (one more round trip)."""
    entries = await queue.dead_letters(model, count)
    derived = [requeue_id(d.job_id) for d in entries]
    found = await queue.records(derived) if derived else []
    return [
        DeadLetterView(d, new if record is not None else None)
        for d, new, record in zip(entries, derived, found, strict=True)
    ]


async def drain_worker(
    registry: WorkerRegistry, models: Sequence[str], consumer: str
) -> str | None:
    """Ask the live worker named `consumer` to drain; the model it serves, None when no model
    of `models` has a live worker of that name."""
    for model in dict.fromkeys(models):
        if await registry.request_drain(model, consumer):
            return model
    return None
