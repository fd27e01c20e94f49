"""One worker process: its engine and broker built from settings, SIGTERM drains it."""

from __future__ import annotations

import asyncio
import signal

from tokenyard.broker import connect
from tokenyard.broker.base import Broker
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines import Engine, make_engine
from tokenyard.engines.process import make_engine_in_process
from tokenyard.worker.worker import Worker


def engine_options(settings: WorkerSettings) -> dict[str, object]:
    """The engine's constructor arguments; the simulated engine has no weights to place."""
    if settings.engine == "sim":
        return {"max_seqs": settings.max_seqs}
    options: dict[str, object] = {
        "model": settings.model,
        "device": settings.device,
        "dtype": settings.dtype,
        "threads": settings.threads,
    }
    if settings.engine == "hf-static":
        # a batch as large as the worker may hold; the engine queues one more behind it
        options["batch_size"] = settings.max_seqs
    else:
        options["max_seqs"] = settings.max_seqs
    return options


async def run_worker(
    broker: Broker, engine: Engine, settings: WorkerSettings, consumer: str | None = None
) -> None:
    """Run a worker until SIGTERM/SIGINT, then drain; the broker is closed at the end."""
    worker = Worker(broker, engine, settings, consumer=consumer)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.drain)
    try:
        await worker.run()
    finally:
        await broker.close()


async def serve_worker(
    broker_settings: BrokerSettings, settings: WorkerSettings, consumer: str | None = None
) -> None:
    """A worker as configured: its broker and engine built from settings."""
    build = make_engine_in_process if settings.engine_process else make_engine
    engine = build(settings.engine, **engine_options(settings))
    await run_worker(connect(broker_settings), engine, settings, consumer)
