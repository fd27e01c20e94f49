"""A job's record as the NATS backend stores it: one KV entry per job, changed only by
compare-and-set on its revision, so every state change (claim, terminal write, cancel) is
fenced against a concurrent one."""

from __future__ import annotations

from typing import Any

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
            holder=self.worker if self.status is JobStatus.RUNNING else None,
            deadline=self.spec.deadline,
            **_fields(self, _SHARED),
        )

    def take_on(self, state: JobState) -> None:
        """The machine's state after a step, into this record (the worker that last held an
        ended job stays named)."""
        for name in _SHARED:
            setattr(self, name, getattr(state, name))
        if not state.terminal:
            self.worker = state.holder

    def record(self) -> JobRecord:
        spec = self.spec
        spec.attempt = max(0, self.deliveries - 1)
        return JobRecord(cancel_requested=self.cancel, **_fields(self, _READ))


def _fields(source: msgspec.Struct, names: tuple[str, ...]) -> dict[str, Any]:
    return {name: getattr(source, name) for name in names}


# What the machine's state and this record both hold, by the same name: copied both ways, so
# a field added to both travels without a line here (`holder` is the record's `worker`, and
# `deadline` its spec's). Likewise what a reader's JobRecord takes of it (`cancel_requested`
# is its `cancel`).
_SHARED = tuple(f for f in JobState.__struct_fields__ if f in StoredJob.__struct_fields__)
_READ = tuple(f for f in JobRecord.__struct_fields__ if f in StoredJob.__struct_fields__)


class Liveness(msgspec.Struct):
    """A model's beating workers, each with when its liveness lapses: one entry per model,
    changed by compare-and-set; a worker leaves it by a reap that took its jobs over."""

    until: dict[str, float] = msgspec.field(default_factory=dict)


def decode_job(raw: bytes) -> StoredJob:
    return decode(raw, StoredJob)


def encode_job(job: StoredJob) -> bytes:
    return encode(job)
