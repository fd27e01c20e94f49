"""`tokenyard autoscale`: the policy's signals as Prometheus gauges, for KEDA or an HPA."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
from typing import Annotated

import msgspec
import typer

from tokenyard.broker import Backend
from tokenyard.cli.options import BrokerOpt, PrefixOpt, with_broker
from tokenyard.config import from_env
from tokenyard.errors import FatalError
from tokenyard.fleet.autoscale import AutoscaleConfig


def autoscale_config(
    workers: str, min_workers: int | None, max_workers: int | None
) -> AutoscaleConfig | None:
    """`--workers auto` → the policy's settings (TOKENYARD_AUTOSCALE_* fill the rest); else None."""
    if workers != "auto":
        if not workers.isdigit():
            raise typer.BadParameter(f"--workers takes a number or `auto`, not {workers!r}")
        if int(workers) == 0:  # nothing would ever run a job, and serve would never be ready
            raise FatalError(
                "--workers 0 starts no worker: give 1 or more, or `--workers auto --min 0` "
                "to start them on demand"
            )
        return None
    config = from_env(
        AutoscaleConfig, "autoscale", min_workers=min_workers, max_workers=max_workers
    )
    if not 0 <= config.min_workers <= config.max_workers or config.max_workers < 1:
        raise FatalError(f"need 0 <= --min <= --max and --max >= 1, got {config}")
    if config.min_workers == 0:  # `--min 0` asks for scale to zero
        config = msgspec.structs.replace(config, scale_to_zero=True)
    return config


def autoscale(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[list[str], typer.Option(help="models to size; repeat for several")] = [  # noqa: B006
        "tiny"
    ],
    host: Annotated[str, typer.Option(help="/metrics address")] = "0.0.0.0",
    port: Annotated[int, typer.Option(help="/metrics port")] = 9105,
    min_workers: Annotated[int | None, typer.Option("--min", help="warm pool")] = None,
    max_workers: Annotated[int | None, typer.Option("--max", help="most workers")] = None,
) -> None:
    """Export tokenyard_desired_workers{model} and its inputs on /metrics; start nothing.

    Point KEDA's prometheus scaler (deploy/k8s/) or an HPA's external metric at it.
    """
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(message)s")
    config = autoscale_config("auto", min_workers, max_workers)
    assert config is not None
    with_broker(broker, prefix, lambda b: _export(b, model, config, host, port))


async def _export(
    broker: Backend, models: list[str], config: AutoscaleConfig, host: str, port: int
) -> None:
    from prometheus_client import start_http_server

    from tokenyard.fleet.supervisor import AutoscaleMetrics, Supervisor

    metrics = AutoscaleMetrics()
    start_http_server(port, addr=host, registry=metrics.registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.gather(
        *(Supervisor(broker, m, config, metrics=metrics).run(stop) for m in models)
    )


def worker_ready(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[
        str | None, typer.Option(help="default: TOKENYARD_WORKER_MODEL, else tiny")
    ] = None,
) -> None:
    """Readiness probe: exit 0 when a worker on this host heartbeats as running, else 1.

    The worker has no HTTP port; its heartbeat in the broker is what the gateway sees.
    """
    name = model or os.environ.get("TOKENYARD_WORKER_MODEL", "tiny")
    ready = with_broker(broker, prefix, lambda b: _worker_ready(b, name))
    raise typer.Exit(0 if ready else 1)


async def _worker_ready(broker: Backend, model: str) -> bool:
    host = socket.gethostname()
    try:
        return any(
            info.host == host and info.state == "running"
            for info in await broker.registry.workers(model)
        )
    except Exception:  # a probe that cannot ask the broker, for whatever reason, says not ready
        return False
