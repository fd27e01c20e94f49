"""`tokenyard serve | gateway | worker | submit | status`."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

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
def worker(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[str, typer.Option(help="model path, or `tiny`")] = "tiny",
    engine: Annotated[str, typer.Option(help="hf | hf-static | sim")] = "hf",
    max_seqs: Annotated[int | None, typer.Option(help="sequences run at once")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    lease_s: Annotated[float | None, typer.Option(help="visibility timeout")] = None,
) -> None:
    """Run one worker: claim jobs for MODEL and run them; SIGTERM drains."""
    from tokenyard.worker.__main__ import serve_worker

    settings = from_env(
        WorkerSettings, "worker", model=model, engine=engine, max_seqs=max_seqs, device=device
    )
    asyncio.run(serve_worker(_broker_settings(broker, prefix, lease_s=lease_s), settings))


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
                    lane.lane.rsplit(":", 1)[-1],
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
