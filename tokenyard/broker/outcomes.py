"""Terminal results the broker writes itself, without an engine."""

from __future__ import annotations

from tokenyard.messages import FinishReason, JobResult, JobStatus


def expired_result() -> JobResult:
    return JobResult(
        status=JobStatus.EXPIRED,
        finish_reason=FinishReason.EXPIRED,
        error="deadline passed before the job started",
    )


def cancelled_result() -> JobResult:
    return JobResult(status=JobStatus.CANCELLED, finish_reason=FinishReason.CANCELLED)


def dead_result(error: str) -> JobResult:
    return JobResult(status=JobStatus.DEAD, finish_reason=FinishReason.ERROR, error=error)
