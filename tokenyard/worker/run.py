"""One worker process: its engine and broker built from settings, SIGTERM drains it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec

from tokenyard import heap, tracing
from tokenyard.broker import Backend, connect
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines import build_engine
from tokenyard.engines.models import local_model, served_names
from tokenyard.errors import FatalError
from tokenyard.metrics import AuditLogMetrics, WorkerMetrics
from tokenyard.worker.worker import Worker

log = logging.getLogger(__name__)
_T = TypeVar("_T")


def run_loop(main: Coroutine[Any, Any, _T]) -> _T:
    """`asyncio.run`, on uvloop where it is installed (uvicorn[standard] brings it, and the
    gateway already runs on it). A worker's per-job path is a handful of socket exchanges
    (Valkey, an upstream) whose wake-ups asyncio's own loop dispatches in Python: on the remote
    engine in front of a mock, 0.54 -> 0.40 ms of the worker's CPU per request in one run
    (docs/benchmarks.md, "Upstream overhead")."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


async def run_worker(backend: Backend, worker: Worker) -> None:
    """Run `worker` until SIGTERM/SIGINT, then drain; `backend`, the one it was built on, is
    closed at the end."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.drain)
    try:
        await worker.run()
    finally:
        await backend.close()


def with_local_model(settings: WorkerSettings) -> WorkerSettings:
    """The settings with the model resolved once, before anything loads it: engines get a local
    directory (a hub id's cached snapshot), the lanes and limits keep its served names (the
    model as named, when none is given). The sim engine loads nothing: its model is a name; the
    remote engine only the tokenizer (a hub id's weights are not fetched for it)."""
    names = served_names(settings.model, settings.served_model_name)
    model = settings.model
    if settings.engine != "sim":
        model = local_model(model, settings.revision, weights=settings.engine != "remote")
    return msgspec.structs.replace(settings, model=model, served_model_name=names)


async def serve_worker(
    broker_settings: BrokerSettings, settings: WorkerSettings, consumer: str | None = None
) -> None:
    """A worker as configured: its broker and engine built from settings, its metrics on
    `metrics_port` when set, its traces exported when OTEL_* asks for them."""
    settings = with_local_model(settings)
    # the worker owns its process: its engine's freed buffers are kept for the next step
    heap.retain_freed_memory()
    metrics = WorkerMetrics(settings.served_model_name[0])
    if settings.metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.metrics_port, registry=metrics.registry)
        log.info("metrics on :%d/metrics", settings.metrics_port)
    tracing.configure("tokenyard-worker")
    try:
        try:
            engine = build_engine(settings)
        except ValueError as exc:  # settings no engine takes: one line, not a traceback
            raise FatalError(f"worker: {exc}") from exc
        backend = connect(broker_settings)
        if backend.audit_log is not None:
            backend.audit_log.observe(AuditLogMetrics("tokenyard_worker", metrics.registry))
        # the worker owns its process, so it may freeze the heap (see `tokenyard.heap`)
        worker = Worker(backend, engine, settings, consumer, metrics, freeze_heap=True)
        await run_worker(backend, worker)
        _Drained.done = True
    finally:
        tracing.shutdown()


class _Drained:
    """Whether this process's worker drained and closed everything (see `exit_if_drained`)."""

    done = False


def exit_if_drained() -> None:
    """For the process's entry point, once its command returned: a process whose worker
    drained ends with its log lines flushed, skipping the interpreter's teardown, in which
    native extensions (torch's triton bindings) print leak reports onto the log stream."""
    if not _Drained.done:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
