"""The gateway app factory; everything it holds lives on app.state.gateway."""

from __future__ import annotations

import inspect
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenyard import heap
from tokenyard.broker import Backend, connect
from tokenyard.config import BrokerSettings, from_env
from tokenyard.engines.base import EngineTokenizer
from tokenyard.gateway.adapters import AdapterBook
from tokenyard.gateway.affinity import PrefixKeys
from tokenyard.gateway.auth import Authenticator, KeyRing
from tokenyard.gateway.batches.files import FileStore
from tokenyard.gateway.batches.service import BatchService
from tokenyard.gateway.cache import ResponseCache
from tokenyard.gateway.enqueue import Enqueuer
from tokenyard.gateway.errors import install_error_handlers
from tokenyard.gateway.events import EventHub
from tokenyard.gateway.fast import FastRoutes, fast_routes
from tokenyard.gateway.instrument import RequestMetricsMiddleware
from tokenyard.gateway.limits import BodyLimitMiddleware, PublishedLimits
from tokenyard.gateway.live import Abandonment
from tokenyard.gateway.openapi import install as install_openapi
from tokenyard.gateway.recorder import Recorder
from tokenyard.gateway.responses_api.service import ResponseService
from tokenyard.gateway.routes import ROUTERS
from tokenyard.gateway.routing import LaneDepths, RoutingRules
from tokenyard.gateway.settings import GatewaySettings, served_models
from tokenyard.gateway.shedding import QueueWaits
from tokenyard.gateway.state import GatewayState
from tokenyard.gateway.tokenizers import load_tokenizers
from tokenyard.metrics import AuditLogMetrics, GatewayMetrics

# Traces are tokenyard's own (tokenyard/tracing.py, carried inside the job). FastAPI >= 0.142's
# native OpenTelemetry would add spans of its own and checks the global providers per request.
_NO_OTEL: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)


class GatewayApp(FastAPI):
    """FastAPI, with the hot POST routes (gateway/fast.py) answered before its middleware stack:
    the layers FastAPI adds for telemetry and its own body limit (both off here) and Starlette's
    dispatch cost ~2 % of its CPU per request. `fast_stack` keeps what they need of the stack."""

    fast_routes: FastRoutes | None = None
    fast_stack: ASGIApp | None = None

    def serve_fast(
        self, routes: FastRoutes, metrics: GatewayMetrics, max_bytes: int, per_path: dict[str, int]
    ) -> None:
        # the same layers, in the same order, as the full stack has around its routes
        errors = self.exception_handlers.get(Exception) or self.exception_handlers.get(500)
        self.fast_routes = routes
        self.fast_stack = ServerErrorMiddleware(
            RequestMetricsMiddleware(BodyLimitMiddleware(routes, max_bytes, per_path), metrics),
            handler=errors,
            debug=self.debug,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        routes = self.fast_routes
        if routes is not None and self.fast_stack is not None and routes.serves(scope):
            scope["app"] = self  # as Starlette sets it: handlers read the state through it
            await self.fast_stack(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(
    settings: GatewaySettings,
    backend: Backend | None = None,
    *,
    broker_settings: BrokerSettings | None = None,
    tokenizers: Mapping[str, EngineTokenizer] | None = None,
    keyring: KeyRing | None = None,
    registry: CollectorRegistry | None = None,
    files: FileStore | None = None,
    freeze_heap: bool = False,
) -> GatewayApp:
    """Build the gateway. A backend passed in stays the caller's; otherwise one is opened from
    `broker_settings` (default: TOKENYARD_BROKER_* environment) and closed at shutdown.
    Tokenizers default to loading each served model's; keys default to `api_keys_file`.
    `freeze_heap`: the gateway owns its process (see `tokenyard.heap`)."""
    metrics = GatewayMetrics(registry)
    keys = keyring if keyring is not None else KeyRing.from_file(settings.api_keys_file)
    served = served_models(settings)
    routing = RoutingRules.from_file(settings.routing_file, served.models)
    routing = routing.with_served_names(served.aliases)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = backend is None
        active = backend or connect(broker_settings or from_env(BrokerSettings, "broker"))
        try:
            loaded = (
                dict(tokenizers)
                if tokenizers is not None
                else await anyio.to_thread.run_sync(load_tokenizers, settings)
            )
            state = GatewayState(
                settings=settings,
                backend=active,
                tokenizers=loaded,
                auth=Authenticator(keys, active.directory, settings.auth_cache_s),
                metrics=metrics,
                enqueuer=Enqueuer(active.queue, metrics, active.quotas),
                events=EventHub(active.queue, settings.event_block_s, settings.max_blocking_reads),
                limits=PublishedLimits(active.registry, settings.limits_ttl_s),
                abandonment=Abandonment(active.queue, settings.stream_resume_grace_s),
                cache=ResponseCache(
                    active.responses,
                    metrics,
                    ttl_s=settings.cache_ttl_s,
                    local_bytes=settings.cache_local_bytes,
                    shared_bytes=settings.cache_shared_bytes,
                ),
                routing=routing,
                served=served,
                adapters=AdapterBook(active.directory, served.models, settings.limits_ttl_s),
                depths=LaneDepths(active.queue),
                waits=QueueWaits(active.queue, active.registry, settings.queue_wait_ttl_s),
                started_at=time.time(),
                prefixes=PrefixKeys(settings.affinity_prefix_tokens),
            )
            state.recorder = Recorder(
                active,
                metrics,
                state.usage,
                lambda: state.served.models,
                uuid.uuid4().hex[:12],
                settings.dashboard_interval_s,
            )
            state.recorder.start()
            app.state.gateway = state
            if active.audit_log is not None and active.audit_log.metrics is None:
                active.audit_log.observe(AuditLogMetrics("tokenyard", metrics.registry))
            app.state.batches = BatchService.start(state, files)
            app.state.responses = ResponseService(state)
            if freeze_heap:
                heap.freeze()
            try:
                yield
            finally:
                await app.state.batches.close()
                await app.state.responses.close()
                await state.close()
        finally:
            if owned:
                await active.close()

    app = GatewayApp(
        title="tokenyard gateway",
        version="0.1.0",
        lifespan=lifespan,
        # served by gateway/openapi.py, behind a key unless `docs_public`
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        **_NO_OTEL,
    )
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_openapi(app, settings, {**{m: m for m in served.models}, **routing.aliases})
    # uploads have their own limit; the multipart framing adds a little
    per_path = {"/v1/files": settings.batch_max_file_bytes + (1 << 16)}
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, per_path=per_path)
    # added last = outermost: the metrics middleware also counts 413s from the body limit
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    if settings.fast_routes:
        app.serve_fast(FastRoutes(fast_routes()), metrics, settings.max_body_bytes, per_path)
    return app
