"""`/dashboard`: a live status page (static HTML polling `/dashboard/data`), no build step.

Its charts are drawn by uPlot, vendored in static/vendor/ (see its README) and served here.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenyard.broker import admin
from tokenyard.broker.core import BrokerStats
from tokenyard.errors import NotFound
from tokenyard.gateway import charts
from tokenyard.gateway.auth import AdminDep, Tenant
from tokenyard.gateway.openapi import DocsDep, answers
from tokenyard.gateway.routes.admin import dead_letter_body
from tokenyard.gateway.state import GatewayState, gateway
from tokenyard.messages import JobRecord, WorkerInfo
from tokenyard.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

router = APIRouter()

SHOWN_JOBS = 25
SHOWN_ERRORS = 50
# what the page loads besides itself; nothing else is served from static/vendor
VENDORED = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css"}


async def dashboard_access(tenant: AdminDep) -> Tenant:
    """Who may read the dashboard's data: it is fleet-wide and shows every tenant's jobs, so
    with API keys configured an admin tenant's key (401 without a key, 403 for a tenant)."""
    return tenant


DashboardDep = Annotated[Tenant, Depends(dashboard_access)]


@router.get("/dashboard", include_in_schema=False)
async def dashboard_page(_: DocsDep) -> HTMLResponse:
    """The page shell; it holds no data (the data route checks for an admin key), so it is
    public with the docs (`docs_public`)."""
    page = resources.files("tokenyard.gateway").joinpath("static/dashboard.html")
    return HTMLResponse(page.read_text(encoding="utf-8"))


@router.get("/dashboard/vendor/{name}", include_in_schema=False)
async def dashboard_vendor(name: str, _: DocsDep) -> Response:
    """The charting library the page loads, served from the package (no CDN)."""
    media = VENDORED.get(name)
    if media is None:
        raise NotFound(f"No file '{name}'")
    body = resources.files("tokenyard.gateway").joinpath(f"static/vendor/{name}").read_bytes()
    return Response(body, media_type=media, headers={"Cache-Control": "max-age=3600"})


@router.get("/dashboard/data", responses=answers(403))
async def dashboard_data(
    request: Request, _: DashboardDep, since: Annotated[float, Query()] = 0.0
) -> JSONResponse:
    """Lanes, workers and dead letters per model, their chart points after `since` (unix s),
    and this gateway's recent jobs."""
    state = gateway(request)
    now = time.time()
    models = await asyncio.gather(*(_model_view(state, m, now, since) for m in state.served.models))
    return JSONResponse({"at": now, "models": models, "jobs": await _recent_jobs(state, now)})


async def _model_view(state: GatewayState, model: str, now: float, since: float) -> dict[str, Any]:
    queue, registry = state.backend.queue, state.backend.registry
    stats, workers, dead = await asyncio.gather(
        queue.stats(model), registry.workers(model), admin.dead_letters(queue, model, SHOWN_ERRORS)
    )
    chart = state.charts.of(model)
    if chart.due(now):
        m = state.metrics
        ttft = charts.histogram_counts(m.time_to_first_token, model, TTFT_BUCKETS)
        e2e = charts.histogram_counts(m.e2e_request_latency, model, REQUEST_LATENCY_BUCKETS)
        chart.add(
            charts.sample(now, stats, workers, ttft, e2e), TTFT_BUCKETS, REQUEST_LATENCY_BUCKETS
        )
    return {
        "model": model,
        **_lanes(stats),
        "workers": [_worker(info, now) for info in workers],
        "jobs_done": sum(info.jobs_done for info in workers),
        "dead": [dead_letter_body(d) for d in dead],
        "chart": chart.since(since),
    }


def _lanes(stats: BrokerStats) -> dict[str, Any]:
    return {
        "lanes": [
            {
                "priority": lane.priority.name.lower(),
                "waiting": lane.waiting,
                "in_flight": lane.in_flight,
                "oldest_age_s": lane.oldest_waiting_age_s,
            }
            for lane in stats.lanes
        ],
        "delayed": stats.delayed,
        "dead_letters": stats.dead_letters,
        "fenced_completions": stats.fenced_completions,
        "expired": stats.expired,
    }


def _worker(info: WorkerInfo, now: float) -> dict[str, Any]:
    return {
        "consumer": info.consumer,
        "engine": info.engine,
        "state": info.state,
        "slots_used": info.slots_used,
        "slots_total": info.slots_total,
        "mean_batch": info.mean_batch,
        "tokens_per_s": info.tokens_per_s,
        "jobs_done": info.jobs_done,
        "heartbeat_age_s": max(0.0, now - info.at),
    }


async def _recent_jobs(state: GatewayState, now: float) -> list[dict[str, Any]]:
    ids = list(state.enqueuer.recent)[-SHOWN_JOBS:][::-1]
    records = await asyncio.gather(*(state.backend.queue.record(job_id) for job_id in ids))
    return [_job(job_id, r, now) for job_id, r in zip(ids, records, strict=True) if r is not None]


def _job(job_id: str, record: JobRecord, now: float) -> dict[str, Any]:
    spec, result = record.spec, record.result
    end = record.finished_at or now
    return {
        "id": job_id,
        "model": spec.model,
        "tenant": spec.tenant,
        "priority": spec.priority.name.lower(),
        "status": record.status.value,
        "created_at": spec.created_at,
        "deliveries": record.deliveries,
        "queued_s": result.queued_s if result and result.queued_s is not None else None,
        "decode_s": result.decode_s if result else None,
        "total_s": max(0.0, end - spec.created_at) if spec.created_at else None,
        "prompt_tokens": result.prompt_tokens if result else len(spec.prompt_token_ids or ()),
        "completion_tokens": result.completion_tokens if result else 0,
        "error": (result.error if result else None) or record.last_error,
    }
