"""A job's record as the NATS backend stores it: one KV entry per job, changed only by
compare-and-set on its revision, so every state change (claim, terminal write, cancel) is
fenced against a concurrent one."""

from __future__ import annotations

import msgspec

from tokenyard.broker.machine import JobState
from tokenyard.messages import (
    JobRecord,
    JobRecordBase,
    JobResult,
    JobStatus,
    decode,
    encode,
)


class StoredJob(JobRecordBase, kw_only=True):
    """The NATS backend's record: the common one, with what its lanes and fences need."""

    cancel: bool = False  # a client asked to cancel it while it ran
    result: JobResult | None = None
    lane: str = ""  # the lane stream and subject its message waits on, and its sequence
    subject: str = ""
    seq: int = 0
    followers: int = 1  # live callers following it (collapsed requests join)
    lease_until: float = 0.0  # the lease's end as the holder's clock saw it at claim or renew
    affinity: bool = False  # taken from a worker's held subject (prefix affinity)
    preemptions: int = 0  # times its holder handed it back for higher-priority work

    @property
    def terminal(self) -> bool:
        return self.status.terminal

    def state(self) -> JobState:
        """What the job state machine decides on (tokenyard/broker/machine.py)."""
        return JobState(
            status=self.status,
            deliveries=self.deliveries,
            holder=self.worker if self.status is JobStatus.RUNNING else None,
            lease_until=self.lease_until,
            deadline=self.spec.deadline,
            cancel=self.cancel,
            followers=self.followers,
            last_error=self.last_error,
            result=self.result,
            started_at=self.started_at,
            finished_at=self.finished_at,
            preemptions=self.preemptions,
        )

    def take_on(self, state: JobState) -> None:
        """The machine's state after a step, into this record (the worker that last held an
        ended job stays named)."""
        self.status = state.status
        self.deliveries = state.deliveries
        if not state.terminal:
            self.worker = state.holder
        self.lease_until = state.lease_until
        self.cancel = state.cancel
        self.followers = state.followers
        self.last_error = state.last_error
        self.result = state.result
        self.started_at = state.started_at
        self.finished_at = state.finished_at
        self.preemptions = state.preemptions

    def record(self) -> JobRecord:
        spec = self.spec
        spec.attempt = max(0, self.deliveries - 1)
        return JobRecord(
            spec=spec,
            status=self.status,
            deliveries=self.deliveries,
            enqueued_at=self.enqueued_at,
            started_at=self.started_at,
            finished_at=self.finished_at,
            worker=self.worker,
            last_error=self.last_error,
            cancel_requested=self.cancel,
            result=self.result,
            preemptions=self.preemptions,
        )


class Liveness(msgspec.Struct):
    """A model's beating workers, each with when its liveness lapses: one entry per model,
    changed by compare-and-set; a worker leaves it by a reap that took its jobs over."""

    until: dict[str, float] = msgspec.field(default_factory=dict)


def decode_job(raw: bytes) -> StoredJob:
    return decode(raw, StoredJob)


def encode_job(job: StoredJob) -> bytes:
    return encode(job)
