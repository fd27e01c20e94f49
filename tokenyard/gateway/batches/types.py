"""OpenAI's batch object, built from the batch record the broker keeps (`messages.BatchRecord`)."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from tokenyard.messages import BatchRecord, BatchStatus

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


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
