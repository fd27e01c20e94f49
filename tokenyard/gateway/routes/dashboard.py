"""`/dashboard`: a live status page (static HTML polling `/dashboard/data`), no build step.

Its charts are drawn by uPlot, vendored in static/vendor/ (see its README) and served here,
from the points every gateway records into the broker (gateway/recorder.py): the first poll
gets the last hour, each later one what came since. `/dashboard/jobs/{id}` is one job's view.
"""

from __future__ import annotations

import asyncio
import logging
import time
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from tokenyard.broker import admin
from tokenyard.broker.core import BrokerStats
from tokenyard.broker.ids import is_job_id
from tokenyard.errors import NotFound
from tokenyard.gateway import charts
from tokenyard.gateway.auth import AdminDep, Tenant
from tokenyard.gateway.charts import Point
from tokenyard.gateway.openapi import DocsDep, answers
from tokenyard.gateway.routes.admin import dead_letter_body
from tokenyard.gateway.routes.jobs import split_id
from tokenyard.gateway.state import GatewayState, gateway
from tokenyard.messages import Finished, JobRecord, WorkerInfo, decode
from tokenyard.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS

log = logging.getLogger(__name__)
router = APIRouter()

SHOWN_JOBS = 25
SHOWN_ERRORS = 50
SHOWN_EVENTS = 10_000  # a job's events read for its view, at most
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
    """Lanes, workers and dead letters per model, the recorded chart points after `since`
    (unix s; at most the last hour): per model, the API's answers by class, per tenant; and
    this gateway's recent jobs."""
    state = gateway(request)
    now = time.time()
    after = max(since, now - charts.KEPT_S)
    step = state.settings.dashboard_interval_s or 5.0
    # the points of the window before `after` too: the first chart point's rates need them
    recorded = await state.backend.series.since(after - max(charts.WINDOW_S, 3 * step))
    drawn = charts.chart(_points(recorded), after, step, TTFT_BUCKETS, REQUEST_LATENCY_BUCKETS)
    models = await asyncio.gather(
        *(_model_view(state, m, drawn["models"].get(m, [])) for m in state.served.models)
    )
    return JSONResponse(
        {
            "at": now,
            "models": models,
            "answers": drawn["answers"],
            "tenants": drawn["tenants"],
            "jobs": await _recent_jobs(state, now),
        }
    )


def _points(recorded: list[tuple[str, float, bytes]]) -> list[charts.Recorded]:
    points = []
    for source, _, value in recorded:
        try:
            points.append((source, decode(value, Point)))
        except ValueError:  # msgspec's DecodeError: a point of another version
            log.debug("a dashboard point of %s not read", source)
    return points


async def _model_view(state: GatewayState, model: str, chart: list[Any]) -> dict[str, Any]:
    queue, registry = state.backend.queue, state.backend.registry
    stats, workers, dead = await asyncio.gather(
        queue.stats(model), registry.workers(model), admin.dead_letters(queue, model, SHOWN_ERRORS)
    )
    now = time.time()
    return {
        "model": model,
        **_lanes(stats),
        "workers": [_worker(info, now) for info in workers],
        "jobs_done": sum(info.jobs_done for info in workers),
        "dead": [dead_letter_body(d) for d in dead],
        "chart": chart,
    }


@router.get("/dashboard/jobs/{job_id}", responses=answers(403, 404))
async def dashboard_job(request: Request, job_id: str, __: DashboardDep) -> JSONResponse:
    """One job, any tenant's: its timings, deliveries, worker, events and error."""
    state = gateway(request)
    bare = split_id(job_id)[0]
    record = await state.backend.queue.record(bare) if is_job_id(bare) else None
    if record is None:
        raise NotFound(f"No job '{job_id}'")
    tokens = chunks = 0
    finish: dict[str, Any] | None = None
    after, read = "0", 0
    while read < SHOWN_EVENTS:
        events = await state.backend.queue.read_events(bare, after=after)
        if not events:
            break
        read += len(events)
        after = events[-1][0]
        for _, event in events:
            if isinstance(event, Finished):
                r = event.result
                finish = {"status": r.status.value, "finish_reason": r.finish_reason}
            else:
                chunks += 1
                tokens += len(event.token_ids)
        if finish is not None:
            break
    body = _job(bare, record, time.time())
    body.update(_timings(record))
    body["worker"] = record.worker or (record.result.worker if record.result else None)
    body["cancel_requested"] = record.cancel_requested
    body["events"] = {"token_events": chunks, "tokens": tokens, "finish": finish}
    return JSONResponse(body)


def _timings(record: JobRecord) -> dict[str, float | None]:
    """When it was received, queued, last started, gave its first token and finished (unix s).
    The first token is the finishing delivery's (its end less its decode time)."""
    result = record.result
    first = None
    if result is not None and result.decode_s is not None and record.finished_at:
        first = record.finished_at - result.decode_s
    return {
        "received_at": record.spec.created_at or None,
        "enqueued_at": record.enqueued_at or None,
        "started_at": record.started_at,
        "first_token_at": first,
        "finished_at": record.finished_at,
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
