"""`tokenyard serve | gateway | worker | submit | status | bench | batch`."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tokenyard.batch.cli import app as batch_app
from tokenyard.bench.command import bench
from tokenyard.broker import connect
from tokenyard.config import BrokerSettings, WorkerSettings, from_env

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console()

BrokerOpt = Annotated[
    str | None, typer.Option("--broker", help="redis://host:port/db; default: TOKENYARD_BROKER_URL")
]
PrefixOpt = Annotated[str | None, typer.Option(help="key prefix, to share one Redis")]


def _broker_settings(
    broker: str | None, prefix: str | None, lease_s: float | None = None
) -> BrokerSettings:
    return from_env(BrokerSettings, "broker", url=broker, prefix=prefix, lease_s=lease_s)


@app.command()
def serve(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[str, typer.Option(help="model path, or `tiny`")] = "tiny",
    engine: Annotated[str, typer.Option(help="hf | hf-static | sim")] = "hf",
    host: Annotated[str, typer.Option(help="gateway address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="gateway port")] = 8000,
    workers: Annotated[int, typer.Option(help="worker processes")] = 1,
    max_seqs: Annotated[int | None, typer.Option(help="sequences per worker")] = None,
    data_dir: Annotated[Path, typer.Option(help="embedded Valkey's data (AOF) directory")] = Path(
        ".tokenyard/valkey"
    ),
) -> None:
    """Everything on one machine: a private Valkey (unless --broker), workers and the gateway."""
    from tokenyard.serve import Stack

    settings = _broker_settings(broker, prefix)
    stack = Stack(
        broker=settings if broker or _env_broker() else None,
        prefix=settings.prefix,
        model=model,
        engine=engine,
        workers=workers,
        max_seqs=max_seqs,
        data_dir=data_dir,
        appendfsync=settings.appendfsync,
    )
    with stack:
        console.print(f"[bold]tokenyard[/] broker {stack.broker_url} · model {model} ({engine})")
        console.print(f"OpenAI API on http://{host}:{port}/v1 — Ctrl-C stops")
        _run_gateway(stack.broker_settings, model, engine, host, port)


def _env_broker() -> bool:
    return bool(os.environ.get("TOKENYARD_BROKER_URL"))


def _run_gateway(
    broker_settings: BrokerSettings, model: str, engine: str, host: str, port: int
) -> None:
    import uvicorn

    from tokenyard.gateway.app import create_app
    from tokenyard.gateway.settings import gateway_settings

    settings = gateway_settings(
        models=model, host=host, port=port, tokenizer="sim" if engine == "sim" else "hf"
    )
    gateway_app = create_app(settings, broker_settings=broker_settings)
    uvicorn.run(gateway_app, host=host, port=port, log_level="warning")


@app.command()
def gateway(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[str, typer.Option(help="model served; its tokenizer is loaded")] = "tiny",
    engine: Annotated[str, typer.Option(help="the workers' engine: hf | sim")] = "hf",
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8000,
) -> None:
    """Run one gateway (OpenAI API) against a shared broker; start as many as you like."""
    _run_gateway(_broker_settings(broker, prefix), model, engine, host, port)


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="the prompt")],
    url: Annotated[str, typer.Option(help="gateway base URL")] = "http://127.0.0.1:8000",
    model: Annotated[str, typer.Option()] = "tiny",
    max_tokens: Annotated[int, typer.Option()] = 64,
    temperature: Annotated[float, typer.Option()] = 0.0,
    chat: Annotated[bool, typer.Option(help="use /v1/chat/completions")] = False,
    api_key: Annotated[str | None, typer.Option(envvar="TOKENYARD_API_KEY")] = None,
) -> None:
    """Send a prompt and stream the answer to the terminal."""
    from tokenyard.submit import stream_completion

    code = asyncio.run(
        stream_completion(url, model, prompt, max_tokens, temperature, chat, api_key, console.print)
    )
    raise typer.Exit(code)


@app.command()
def worker(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[str | None, typer.Option(help="model path, or `tiny`")] = None,
    engine: Annotated[str | None, typer.Option(help="hf | hf-static | sim")] = None,
    max_seqs: Annotated[int | None, typer.Option(help="sequences run at once")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    lease_s: Annotated[float | None, typer.Option(help="visibility timeout")] = None,
    drain_timeout_s: Annotated[float | None, typer.Option(help="SIGTERM grace")] = None,
    consumer: Annotated[str | None, typer.Option(help="consumer name")] = None,
    log_level: Annotated[str, typer.Option(help="logging level")] = "INFO",
) -> None:
    """Run one worker: claim jobs for MODEL and run them; SIGTERM drains.

    Options left out come from TOKENYARD_WORKER_* / TOKENYARD_BROKER_* variables.
    """
    import logging

    from tokenyard.worker.run import serve_worker

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    settings = from_env(
        WorkerSettings,
        "worker",
        model=model,
        engine=engine,
        max_seqs=max_seqs,
        device=device,
        threads=threads,
        drain_timeout_s=drain_timeout_s,
    )
    broker_settings = _broker_settings(broker, prefix, lease_s=lease_s)
    asyncio.run(serve_worker(broker_settings, settings, consumer=consumer))


@app.command()
def status(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[list[str] | None, typer.Option(help="models to show; default all")] = None,
) -> None:
    """Lanes, depths, oldest job and live workers, as tables."""
    asyncio.run(_status(_broker_settings(broker, prefix), model or []))


async def _status(settings: BrokerSettings, models: list[str]) -> None:
    broker = connect(settings)
    try:
        for name in models or await broker.models():
            stats = await broker.stats(name)
            lanes = Table(title=f"model {name}")
            for column in ("lane", "waiting", "in flight", "oldest waiting"):
                lanes.add_column(column, justify="right" if column != "lane" else "left")
            for lane in stats.lanes:
                age = lane.oldest_waiting_age_s
                lanes.add_row(
                    lane.priority.name.lower(),
                    str(lane.waiting),
                    str(lane.in_flight),
                    "-" if age is None else f"{age:.1f}s",
                )
            console.print(lanes)
            console.print(
                f"delayed retries {stats.delayed} · dead letters {stats.dead_letters} · "
                f"expired {stats.expired} · fenced completions {stats.fenced_completions}"
            )
            workers = Table(title=f"live workers of {name}")
            for column in ("consumer", "engine", "state", "slots", "tokens/s", "batch", "done"):
                workers.add_column(column)
            for info in await broker.workers(name):
                workers.add_row(
                    info.consumer,
                    info.engine,
                    info.state,
                    f"{info.slots_used}/{info.slots_total}",
                    f"{info.tokens_per_s:.1f}",
                    f"{info.mean_batch:.2f}",
                    str(info.jobs_done),
                )
            console.print(workers)
    finally:
        await broker.close()


app.command("bench")(bench)
app.add_typer(batch_app, name="batch")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
