"""Liveness, readiness and Prometheus metrics; the root sends a browser to the API's docs."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from tokenyard.gateway.auth import ScrapeDep
from tokenyard.gateway.errors import ApiError
from tokenyard.gateway.openapi import answers
from tokenyard.gateway.state import GatewayState, gateway

router = APIRouter()


@router.get("/healthz")
async def healthz() -> JSONResponse:
    """The process serves HTTP; says nothing about the broker or workers."""
    return JSONResponse({"status": "ok"})


@router.get(
    "/health",
    response_class=Response,
    responses={200: {"description": "The process serves HTTP (no body, as vLLM's)"}},
)
async def health() -> Response:
    """As vLLM's /health: 200 with no body while the process serves HTTP (so probes written
    for vLLM work unchanged); /readyz says whether jobs can run."""
    return Response(status_code=200)


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    """A browser opening the server's address lands on the API's docs."""
    return RedirectResponse("/docs", status_code=307)


@router.get("/readyz", responses=answers(503))
async def readyz(request: Request) -> JSONResponse:
    """Ready when the broker answers and every served model has a live worker."""
    state = gateway(request)
    if not await state.backend.ping():
        raise ApiError(503, "not ready: the broker does not answer", code="broker_unavailable")
    live: dict[str, int] = {}
    for model in state.served.models:
        live[model] = len(await state.backend.registry.workers(model))
        if state.settings.require_workers and not live[model]:
            raise ApiError(
                503, f"not ready: no live worker for model '{model}'", code="no_live_worker"
            )
    return JSONResponse({"status": "ready", "workers": live})


async def _sample_queues(state: GatewayState) -> None:
    m, backend = state.metrics, state.backend
    for model in state.served.models:
        stats = await backend.queue.stats(model)
        for lane in stats.lanes:
            priority = lane.priority.name.lower()
            m.queue_depth.labels(model, priority).set(lane.waiting)
            m.queue_in_flight.labels(model, priority).set(lane.in_flight)
            m.queue_oldest_age.labels(model, priority).set(lane.oldest_waiting_age_s or 0.0)
        m.dead_letters.labels(model).set(stats.dead_letters)
        m.live_workers.labels(model).set(len(await backend.registry.workers(model)))


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        **answers(403),
        200: {"description": "Prometheus text format", "content": {"text/plain": {}}},
    },
)
async def metrics(request: Request, _: ScrapeDep) -> Response:
    """Prometheus text format; queue gauges are sampled from the broker on each scrape.
    Fleet-wide, so with keys configured it needs an admin key (a scrape's bearer token)."""
    state = gateway(request)
    up = 0
    with contextlib.suppress(Exception):  # a scrape must answer even when the broker is down
        await _sample_queues(state)
        up = 1
    state.metrics.broker_up.set(up)
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
