"""Operators' actions, for an admin key: dead letters (list, requeue), drain a worker, cancel
any tenant's job. The dashboard's buttons call them; `tokenyard dlq` and `tokenyard drain` do
the same on the broker (tokenyard/broker/admin.py holds both)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from tokenyard.broker import admin, is_job_id
from tokenyard.gateway.auth import AdminDep
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.openapi import answers
from tokenyard.gateway.routes.jobs import cancel_reply, split_id
from tokenyard.gateway.state import gateway

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
