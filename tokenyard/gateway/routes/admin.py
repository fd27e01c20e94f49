"""Operators' actions, for an admin key: dead letters (list, requeue), drain a worker, cancel
any tenant's job, LoRA adapters (list, add, delete). The dashboard's buttons call them;
`tokenyard dlq`, `tokenyard drain` and `tokenyard lora` do the same on the broker."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenyard.broker import admin, is_job_id
from tokenyard.errors import NotFound
from tokenyard.gateway.auth import AdminDep
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.openapi import answers
from tokenyard.gateway.routes.jobs import cancel_reply, split_id
from tokenyard.gateway.state import gateway
from tokenyard.messages import AdapterRecord

router = APIRouter(prefix="/admin", tags=["admin"])


@router.get("/dead_letters", responses=answers(403))
async def list_dead_letters(
    request: Request,
    _: AdminDep,
    model: Annotated[str | None, Query(max_length=256)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JSONResponse:
    """Dead letters of one model (default: every served one): job, reason, error, and the job
    a requeue made of it."""
    state = gateway(request)
    rows: list[dict[str, Any]] = []
    for name in [model] if model else state.served.models:
        rows += map(dead_letter_body, await admin.dead_letters(state.backend.queue, name, limit))
    return JSONResponse({"object": "list", "data": rows})


def dead_letter_body(d: admin.DeadLetterView) -> dict[str, Any]:
    """A dead letter as the admin API and the dashboard show it."""
    return {
        "job_id": d.entry.job_id,
        "model": d.entry.model,
        "priority": d.entry.priority.name.lower(),
        "reason": d.entry.reason,
        "error": d.entry.error,
        "deliveries": d.entry.deliveries,
        "at": d.entry.at,
        "requeued_as": d.requeued_as,
    }


@router.post("/dead_letters/{job_id}/requeue", responses=answers(403, 404, 409, 429))
async def requeue_dead_letter(request: Request, job_id: str, _: AdminDep) -> JSONResponse:
    """Queue a dead job again as a new job (once: asking again answers the same job)."""
    bare, _kind = split_id(job_id)
    if not is_job_id(bare):
        raise _no_dead_letter(job_id)
    done = await admin.requeue_dead(gateway(request).backend.queue, bare)
    if done.outcome is admin.RequeueOutcome.NOT_FOUND:
        raise _no_dead_letter(job_id)
    if done.outcome is admin.RequeueOutcome.NOT_DEAD:
        raise ApiError(
            409, f"Job '{job_id}' is {done.status}, not a dead letter", code="not_a_dead_letter"
        )
    created = done.outcome is admin.RequeueOutcome.REQUEUED
    return JSONResponse(
        {"job_id": bare, "requeued_as": done.requeued_as, "status": done.outcome.value},
        status_code=201 if created else 200,
    )


@router.post("/workers/{consumer}/drain", responses={**answers(403, 404), 202: {}})
async def drain_worker(request: Request, consumer: str, _: AdminDep) -> JSONResponse:
    """Ask a live worker to drain (as SIGTERM does: it stops claiming, finishes or hands back
    its jobs, and exits); it reads the request at its next heartbeat."""
    state = gateway(request)
    models = [*state.served.models, *await state.backend.queue.models()]
    model = await admin.drain_worker(state.backend.registry, models, consumer)
    if model is None:
        raise ApiError(404, f"No live worker named '{consumer}'", code="worker_not_found")
    return JSONResponse({"worker": consumer, "model": model, "state": "draining"}, 202)


@router.post("/jobs/{job_id}/cancel", responses={**answers(403, 404, 409), 202: {}})
async def cancel_any_job(request: Request, job_id: str, _: AdminDep) -> JSONResponse:
    """Cancel any tenant's job, as DELETE /v1/jobs/{id} cancels one's own."""
    bare, _kind = split_id(job_id)
    if not is_job_id(bare):
        raise ApiError(404, f"No job with id '{job_id}'", code="job_not_found")
    return await cancel_reply(gateway(request), bare, job_id)


def _no_dead_letter(job_id: str) -> ApiError:
    return ApiError(404, f"No dead job with id '{job_id}'", code="job_not_found")


class AdapterBody(BaseModel):
    """POST /admin/loras: a LoRA adapter served as `name` on every worker of `model`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: Annotated[str, Field(min_length=1, max_length=256)]
    model: Annotated[str, Field(min_length=1, max_length=256)]  # its base model
    path: Annotated[str, Field(min_length=1, max_length=4096)]  # a PEFT directory or hub id


@router.get("/loras", responses=answers(403))
async def list_adapters(request: Request, _: AdminDep) -> JSONResponse:
    """Every LoRA adapter in the broker's directory, with its base model and path."""
    records = await gateway(request).backend.directory.adapters()
    return JSONResponse({"object": "list", "data": [adapter_body(a) for a in records]})


@router.post("/loras", responses={**answers(403, 404, 409), 201: {}})
async def add_adapter(request: Request, body: AdapterBody, _: AdminDep) -> JSONResponse:
    """Add (or replace) a LoRA adapter: every gateway routes `name` to its base model's lanes
    with the adapter, and each worker of that model loads it from `path` when a job needs it
    (what `--lora NAME=PATH` does for one worker)."""
    state = gateway(request)
    if body.model not in state.served.models:
        raise NotFound(
            f"The model '{body.model}' does not exist", param="model", code="model_not_found"
        )
    if body.name in state.served.names or body.name in state.routing.aliases:
        raise ApiError(
            409,
            f"'{body.name}' is already a served model's name",
            param="name",
            code="model_name_taken",
        )
    record = AdapterRecord(name=body.name, base=body.model, path=body.path, created_at=time.time())
    await state.backend.directory.put_adapter(record)
    return JSONResponse(adapter_body(record), status_code=201)


@router.delete("/loras/{name}", responses=answers(403, 404))
async def delete_adapter(request: Request, name: str, _: AdminDep) -> JSONResponse:
    """Stop serving an adapter (jobs already queued with it still run)."""
    if not await gateway(request).backend.directory.delete_adapter(name):
        raise ApiError(404, f"No LoRA adapter named '{name}'", code="model_not_found")
    return JSONResponse({"name": name, "object": "lora", "deleted": True})


def adapter_body(record: AdapterRecord) -> dict[str, Any]:
    return {
        "name": record.name,
        "object": "lora",
        "model": record.base,
        "path": record.path,
        "created_at": record.created_at,
    }
