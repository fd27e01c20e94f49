"""Batch records as the broker keeps them, and OpenAI's batch object built from them."""

from __future__ import annotations

import enum
import uuid
from typing import Any

import msgspec

WIRE_VERSION = 1
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class BatchStatus(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (
            BatchStatus.FAILED,
            BatchStatus.COMPLETED,
            BatchStatus.EXPIRED,
            BatchStatus.CANCELLED,
        )


class LineError(msgspec.Struct, kw_only=True):
    """One of a batch's validation errors; `line` is 1-based, as OpenAI reports it."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchRecord(msgspec.Struct, kw_only=True):
    """A batch as the runner drives it. The request outcomes live beside it (see BatchStore)."""

    v: int = WIRE_VERSION
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus = BatchStatus.VALIDATING
    created_at: int
    expires_at: int
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[LineError] = msgspec.field(default_factory=list)
    total: int = 0
    submitted: int = 0  # lines 0..submitted-1 have a job (or an admission error)
    metadata: dict[str, str] | None = None
    model: str | None = None
    prompt_tokens: int = 0  # of the requests counted so far (a progress figure)
    completion_tokens: int = 0


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex}"


def batch_body(
    rec: BatchRecord, completed: int, failed: int, cancel_requested: bool
) -> dict[str, Any]:
    """OpenAI's batch object; a cancel asked for but not yet seen by the runner shows as
    `cancelling`, as OpenAI answers the cancel call."""
    status = rec.status
    cancelling_at = rec.cancelling_at
    if cancel_requested and not status.terminal and status is not BatchStatus.FINALIZING:
        status = BatchStatus.CANCELLING
    return {
        "id": rec.id,
        "object": "batch",
        "endpoint": rec.endpoint,
        "model": rec.model,
        "errors": (
            {"object": "list", "data": [msgspec.to_builtins(e) for e in rec.errors]}
            if rec.errors
            else None
        ),
        "input_file_id": rec.input_file_id,
        "completion_window": rec.completion_window,
        "status": status.value,
        "output_file_id": rec.output_file_id,
        "error_file_id": rec.error_file_id,
        "created_at": rec.created_at,
        "in_progress_at": rec.in_progress_at,
        "expires_at": rec.expires_at,
        "finalizing_at": rec.finalizing_at,
        "completed_at": rec.completed_at,
        "failed_at": rec.failed_at,
        "expired_at": rec.expired_at,
        "cancelling_at": cancelling_at,
        "cancelled_at": rec.cancelled_at,
        "request_counts": {"total": rec.total, "completed": completed, "failed": failed},
        "usage": {
            "input_tokens": rec.prompt_tokens,
            "output_tokens": rec.completion_tokens,
            "total_tokens": rec.prompt_tokens + rec.completion_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
        "metadata": rec.metadata,
    }
