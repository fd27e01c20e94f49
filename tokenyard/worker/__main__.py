"""`python -m tokenyard.worker`: one worker process; SIGTERM drains it."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from tokenyard.broker import connect
from tokenyard.broker.base import Broker
from tokenyard.config import BrokerSettings, WorkerSettings, from_env
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokenyard.worker")
    parser.add_argument("--broker", help="redis://… URL")
    parser.add_argument("--prefix")
    parser.add_argument("--lease-s", type=float)
    parser.add_argument("--model")
    parser.add_argument("--engine")
    parser.add_argument("--max-seqs", type=int)
    parser.add_argument("--drain-timeout-s", type=float)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--consumer")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    broker_settings = from_env(
        BrokerSettings, "broker", url=args.broker, prefix=args.prefix, lease_s=args.lease_s
    )
    settings = from_env(
        WorkerSettings,
        "worker",
        model=args.model,
        engine=args.engine,
        max_seqs=args.max_seqs,
        drain_timeout_s=args.drain_timeout_s,
        threads=args.threads,
    )
    asyncio.run(serve_worker(broker_settings, settings, consumer=args.consumer))


if __name__ == "__main__":
    main()
