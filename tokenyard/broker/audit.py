"""The audit trail: one entry when a job is received, one when it reaches a terminal state,
and one each time it is preempted (handed back for higher-priority work).

Entries are appended to a bounded stream (Redis: one stream under its own hash tag, trimmed
with MAXLEN ~ `BrokerSettings.audit_max_len`, redis/tables.py). Building an entry and parsing
`--since` are pure; a backend's queue writes them and its audit table reads them. An audit
table can also hand what was written to an `AuditSink` (the Kafka audit log, kafka.py).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol, runtime_checkable

import msgspec

from tokenyard.messages import JobResult, JobSpec

RECEIVED = "received"
TERMINAL = "terminal"
PREEMPTED = "preempted"


class AuditEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One line of the audit trail; `at` is when it was written (unix s)."""

    event: str  # received | preempted | terminal
    at: float
    job_id: str
    tenant: str
    model: str
    priority: str
    status: str  # queued at receipt; then succeeded | failed | cancelled | expired | dead
    prompt_tokens: int = 0
    max_tokens: int = 0
    completion_tokens: int = 0
    received_at: float = 0.0  # the gateway's receipt time (JobSpec.created_at)
    queued_s: float | None = None  # receipt to the start of the delivery that finished it
    decode_s: float | None = None
    total_s: float | None = None  # receipt to terminal state
    finish_reason: str | None = None
    error: str | None = None
    adapter: str | None = None  # the LoRA adapter the job ran with (none: the base model)


class AuditSink(Protocol):
    """Takes the entries an audit table wrote; never blocks nor fails its caller."""

    def offer(self, entries: Sequence[AuditEntry]) -> None: ...


@runtime_checkable
class Mirrored(Protocol):
    """An audit table that hands each entry whose state change stood to a sink as well."""

    def mirror_to(self, sink: AuditSink) -> None: ...

    async def flush_mirror(self) -> None:
        """Hand over at once what is still held back (at shutdown)."""
        ...


def received(spec: JobSpec, now: float) -> AuditEntry:
    """The receipt of a job the broker accepted."""
    return AuditEntry(
        event=RECEIVED,
        at=now,
        job_id=spec.id,
        tenant=spec.tenant,
        model=spec.model,
        priority=spec.priority.name.lower(),
        status="queued",
        prompt_tokens=len(spec.prompt_token_ids or ()),
        max_tokens=spec.sampling.max_tokens,
        received_at=spec.created_at or now,
        adapter=spec.adapter or None,
    )


def terminal(spec: JobSpec, result: JobResult, now: float) -> AuditEntry:
    """A job's terminal state, with its real token counts and timings."""
    # the job's identity and request as its receipt recorded them; the rest is the outcome
    return msgspec.structs.replace(
        received(spec, now),
        event=TERMINAL,
        status=result.status.value,
        prompt_tokens=result.prompt_tokens or len(spec.prompt_token_ids or ()),
        completion_tokens=result.completion_tokens,
        received_at=spec.created_at,
        queued_s=result.queued_s,
        decode_s=result.decode_s,
        total_s=max(0.0, now - spec.created_at) if spec.created_at else None,
        finish_reason=None if result.finish_reason is None else result.finish_reason.value,
        error=result.error,
    )


def preempted(spec: JobSpec, now: float) -> AuditEntry:
    """A running job handed back to its lane for higher-priority work (it resumes later)."""
    return msgspec.structs.replace(
        received(spec, now), event=PREEMPTED, received_at=spec.created_at
    )


def matches(entry: AuditEntry, since: float, tenant: str | None, model: str | None) -> bool:
    """The export's filter."""
    return (
        entry.at >= since
        and (tenant is None or entry.tenant == tenant)
        and (model is None or entry.model == model)
    )


_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: float | None = None) -> float:
    """`--since`: unix seconds, an ISO 8601 time (UTC unless it says), or relative (`90s`,
    `15m`, `1h`, `2d`, `1w`: that long before now)."""
    now = time.time() if now is None else now
    match = _RELATIVE.match(text)
    if match:
        return now - float(match.group(1)) * _UNIT_S[match.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"--since: not a time: {text!r} (unix s, ISO 8601, or 1h/30m/2d)") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()
