"""One worker process: its engine and broker built from settings, SIGTERM drains it."""

from __future__ import annotations

import asyncio
import signal

from tokenyard.broker import connect
from tokenyard.broker.base import Broker
from tokenyard.config import BrokerSettings, WorkerSettings
from tokenyard.engines import Engine, build_engine
from tokenyard.worker.worker import Worker


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
    await run_worker(connect(broker_settings), build_engine(settings), settings, consumer)
