"""One worker process: its engine and broker built from settings, SIGTERM drains it."""

from __future__ import annotations

import asyncio
import logging
import signal

from tokenyard import tracing
from tokenyard.broker import Backend, connect
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines import Engine, build_engine
from tokenyard.metrics import WorkerMetrics
from tokenyard.worker.worker import Worker

log = logging.getLogger(__name__)


async def run_worker(
    backend: Backend,
    engine: Engine,
    settings: WorkerSettings,
    consumer: str | None = None,
    metrics: WorkerMetrics | None = None,
    *,
    freeze_heap: bool = False,
) -> None:
    """Run a worker until SIGTERM/SIGINT, then drain; the backend is closed at the end.
    `freeze_heap`: the worker owns its process (see `tokenyard.heap`)."""
    worker = Worker(
        backend, engine, settings, consumer=consumer, metrics=metrics, freeze_heap=freeze_heap
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.drain)
    try:
        await worker.run()
    finally:
        await backend.close()


async def serve_worker(
    broker_settings: BrokerSettings, settings: WorkerSettings, consumer: str | None = None
) -> None:
    """A worker as configured: its broker and engine built from settings, its metrics on
    `metrics_port` when set, its traces exported when OTEL_* asks for them."""
    metrics = WorkerMetrics(settings.model)
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, registry=metrics.registry)
        log.info("metrics on :%d/metrics", settings.metrics_port)
    tracing.configure("tokenyard-worker")
    try:
        engine = build_engine(settings)
        await run_worker(
            connect(broker_settings), engine, settings, consumer, metrics, freeze_heap=True
        )
    finally:
        tracing.shutdown()
