"""`tokenyard serve | gateway | worker | submit | status | bench | keys | tenants | batch`."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from prometheus_client import CollectorRegistry
from rich.console import Console
from rich.table import Table

from tokenyard.broker import Backend, check_url, redacted
from tokenyard.cli.audit import audit
from tokenyard.cli.autoscale import autoscale, worker_ready
from tokenyard.cli.batch import app as batch_app
from tokenyard.cli.bench import bench
from tokenyard.cli.config import config_app
from tokenyard.cli.engine import (
    EngineOpt,
    SimDecodeBaseOpt,
    SimDecodePerSeqOpt,
    SimPrefillBaseOpt,
    SimPrefillPerTokenOpt,
    engine_choice,
    export_to_workers,
    sim_cost,
)
from tokenyard.cli.options import (
    AuditKafkaOpt,
    BrokerOpt,
    PrefixOpt,
    TablesOpt,
    broker_settings,
    with_broker,
)
from tokenyard.config import (
    CONFIG_ENV,
    BrokerSettings,
    WorkerSettings,
    from_env,
    setting_sources,
)
from tokenyard.errors import FatalError
from tokenyard.logs import LogFormat, setup_logging

if TYPE_CHECKING:
    from tokenyard.gateway.settings import GatewaySettings
from tokenyard.cli.tenants import keys_app, tenants_app

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
console = Console()

ModelOpt = Annotated[str | None, typer.Option(help="model path, or `tiny`")]
LogFormatOpt = Annotated[
    LogFormat, typer.Option(envvar="TOKENYARD_LOG_FORMAT", help="text | json (one object a line)")
]


@app.callback()
def _options(
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar=CONFIG_ENV,
            help="TOML file with [broker] [worker] [gateway] tables; flags > env > file",
        ),
    ] = None,
) -> None:
    if config is not None:
        # every settings lookup reads it from here, and serve's worker processes inherit it
        os.environ[CONFIG_ENV] = str(config)


ServeBrokerOpt = Annotated[
    str | None,
    typer.Option(
        "--broker",
        help="a broker URL (redis://, nats://, amqp://...), or `nats` / `valkey` for a private "
        "server in --data-dir; default: TOKENYARD_BROKER_URL, else a private Valkey",
    ),
]


@app.command()
def serve(
    broker: ServeBrokerOpt = None,
    tables: TablesOpt = None,
    prefix: PrefixOpt = None,
    model: ModelOpt = None,
    engine: EngineOpt = None,
    host: Annotated[str | None, typer.Option(help="gateway address")] = None,
    port: Annotated[int | None, typer.Option(help="gateway port")] = None,
    workers: Annotated[str, typer.Option(help="worker processes, or `auto`")] = "1",
    max_seqs: Annotated[int | None, typer.Option(help="sequences per worker")] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="the private server's data; default .tokenyard/valkey or /nats"),
    ] = None,
    min_workers: Annotated[int | None, typer.Option("--min", help="auto: warm pool")] = None,
    max_workers: Annotated[int | None, typer.Option("--max", help="auto: most workers")] = None,
    audit_kafka: AuditKafkaOpt = None,
    log_format: LogFormatOpt = LogFormat.TEXT,
    sim_prefill_base_s: SimPrefillBaseOpt = None,
    sim_prefill_per_token_s: SimPrefillPerTokenOpt = None,
    sim_decode_base_s: SimDecodeBaseOpt = None,
    sim_decode_per_seq_s: SimDecodePerSeqOpt = None,
) -> None:
    """Everything on one machine: a private Valkey (or with `--broker nats` a private
    nats-server; none when --broker names a URL, except a private Valkey for the tables of
    amqp:// lanes given no --tables), workers and the gateway.

    Options left out come from TOKENYARD_WORKER_* / TOKENYARD_GATEWAY_* / TOKENYARD_BROKER_*;
    every worker's metrics are served with the gateway's on its /metrics.
    """
    from tokenyard.cli.autoscale import autoscale_config
    from tokenyard.fleet.serve import EMBEDDED, Stack

    setup_logging("INFO", log_format)
    settings = broker_settings(
        broker, prefix, required=False, tables=tables, audit_kafka=audit_kafka
    )
    # a URL named anywhere (flag, env, file) is used; a bare `nats` / `valkey`, or nothing,
    # names the private server serve runs itself
    private = next((kind for kind in EMBEDDED if kind == (settings.url or "valkey")), None)
    if private is None:
        check_url(settings.url)
    sim = sim_cost(
        sim_prefill_base_s, sim_prefill_per_token_s, sim_decode_base_s, sim_decode_per_seq_s
    )
    worker_settings = from_env(
        WorkerSettings, "worker", model=model, engine=engine, max_seqs=max_seqs, **sim
    )
    export_to_workers(sim)
    # decided once here, so every worker runs the engine the start line names
    chosen = engine_choice(worker_settings, engine)
    auto = autoscale_config(workers, min_workers, max_workers)
    stack = Stack(
        external=settings if private is None else None,
        embedded=private or "valkey",
        prefix=settings.prefix,
        model=worker_settings.model,
        engine=chosen.engine,
        n_workers=0 if auto else int(workers),
        max_seqs=worker_settings.max_seqs,
        data_dir=data_dir or Path(".tokenyard", private or "valkey"),
        appendfsync=settings.appendfsync,
        autoscale=auto,
        log_format=log_format,
        given=settings,
    )
    gw = _gateway_settings(worker_settings.model, chosen.engine, host, port)
    # uvicorn re-raises the SIGTERM it handled once it has shut down: turn it into an exit
    # that unwinds the stack (workers drain, the private server stops) instead of killing it
    signal.signal(signal.SIGTERM, _exit_on_signal)
    with stack:
        tables_note = f" · tables {stack.tables_url}" if stack.tables_url else ""
        console.print(
            f"[bold]tokenyard[/] broker {redacted(stack.broker_url)}{tables_note} · "
            f"model {worker_settings.model} · engine {chosen.engine} ({chosen.reason})"
        )
        console.print(f"OpenAI API on http://{gw.host}:{gw.port}/v1 — Ctrl-C stops")
        _run_gateway(stack.broker_settings, gw, stack.registry)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _gateway_settings(
    model: str | None, engine: str | None, host: str | None, port: int | None
) -> GatewaySettings:
    """Flags, then TOKENYARD_GATEWAY_*, then the config file, then defaults; the tokenizer
    family follows the workers' engine (flag, env or file) unless the gateway's is set."""
    from tokenyard.gateway.settings import GatewaySettings, gateway_settings

    tokenizer = None
    workers = setting_sources(WorkerSettings, "worker", engine=engine)
    if "engine" in workers and "tokenizer" not in setting_sources(GatewaySettings, "gateway"):
        tokenizer = "sim" if workers["engine"][0] == "sim" else "hf"
    return gateway_settings(models=model, host=host, port=port, tokenizer=tokenizer)


def _run_gateway(
    broker_settings: BrokerSettings,
    settings: GatewaySettings,
    registry: CollectorRegistry | None = None,
) -> None:
    import uvicorn

    from tokenyard import tracing
    from tokenyard.gateway.app import create_app

    tracing.configure("tokenyard-gateway")
    gateway_app = create_app(
        settings, broker_settings=broker_settings, registry=registry, freeze_heap=True
    )
    try:
        # access lines are below the log level anyway; off, uvicorn skips formatting them
        uvicorn.run(
            gateway_app,
            host=settings.host,
            port=settings.port,
            log_level="warning",
            access_log=False,
        )
    finally:
        tracing.shutdown()


@app.command()
def gateway(
    broker: BrokerOpt = None,
    tables: TablesOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[
        str | None, typer.Option(help="models served (comma list); their tokenizers are loaded")
    ] = None,
    engine: Annotated[str | None, typer.Option(help="the workers' engine: hf | sim")] = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    audit_kafka: AuditKafkaOpt = None,
    log_format: LogFormatOpt = LogFormat.TEXT,
) -> None:
    """Run one gateway (OpenAI API) against a shared broker; start as many as you like.

    Options left out come from TOKENYARD_GATEWAY_* / TOKENYARD_BROKER_* variables.
    """
    setup_logging("INFO", log_format)
    _run_gateway(
        broker_settings(broker, prefix, tables=tables, audit_kafka=audit_kafka),
        _gateway_settings(model, engine, host, port),
    )


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="the prompt")],
    url: Annotated[
        str | None, typer.Option(help="gateway base URL; default: TOKENYARD_GATEWAY_HOST/_PORT")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="default: the first of TOKENYARD_GATEWAY_MODELS")
    ] = None,
    max_tokens: Annotated[int, typer.Option()] = 64,
    temperature: Annotated[float, typer.Option()] = 0.0,
    chat: Annotated[bool, typer.Option(help="use /v1/chat/completions")] = False,
    api_key: Annotated[str | None, typer.Option(envvar="TOKENYARD_API_KEY")] = None,
) -> None:
    """Send a prompt and stream the answer to the terminal."""
    from tokenyard.cli.submit import stream_completion
    from tokenyard.gateway.settings import gateway_settings

    if url is None or model is None:
        gw = gateway_settings()
        host = "127.0.0.1" if gw.host in ("0.0.0.0", "::", "") else gw.host
        url = url or f"http://{host}:{gw.port}"
        model = model or gw.models[0]
    code = asyncio.run(
        stream_completion(url, model, prompt, max_tokens, temperature, chat, api_key, console.print)
    )
    raise typer.Exit(code)


@app.command()
def worker(
    broker: BrokerOpt = None,
    tables: TablesOpt = None,
    prefix: PrefixOpt = None,
    model: ModelOpt = None,
    engine: EngineOpt = None,
    max_seqs: Annotated[int | None, typer.Option(help="sequences run at once")] = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    lease_s: Annotated[float | None, typer.Option(help="visibility timeout")] = None,
    drain_timeout_s: Annotated[float | None, typer.Option(help="SIGTERM grace")] = None,
    consumer: Annotated[str | None, typer.Option(help="consumer name")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="serve Prometheus metrics on this port; 0: off")
    ] = None,
    log_level: Annotated[str, typer.Option(help="logging level")] = "INFO",
    audit_kafka: AuditKafkaOpt = None,
    log_format: LogFormatOpt = LogFormat.TEXT,
    sim_prefill_base_s: SimPrefillBaseOpt = None,
    sim_prefill_per_token_s: SimPrefillPerTokenOpt = None,
    sim_decode_base_s: SimDecodeBaseOpt = None,
    sim_decode_per_seq_s: SimDecodePerSeqOpt = None,
) -> None:
    """Run one worker: claim jobs for MODEL and run them; SIGTERM drains.

    Options left out come from TOKENYARD_WORKER_* / TOKENYARD_BROKER_* variables.
    """
    from tokenyard.worker.run import serve_worker

    setup_logging(log_level, log_format)
    settings = from_env(
        WorkerSettings,
        "worker",
        model=model,
        engine=engine,
        max_seqs=max_seqs,
        device=device,
        threads=threads,
        drain_timeout_s=drain_timeout_s,
        metrics_port=metrics_port,
        **sim_cost(
            sim_prefill_base_s, sim_prefill_per_token_s, sim_decode_base_s, sim_decode_per_seq_s
        ),
    )
    queue = broker_settings(broker, prefix, lease_s=lease_s, tables=tables, audit_kafka=audit_kafka)
    asyncio.run(serve_worker(queue, settings, consumer=consumer))


@app.command()
def status(
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[list[str] | None, typer.Option(help="models to show; default all")] = None,
) -> None:
    """Lanes, depths, oldest job and live workers, as tables."""
    with_broker(broker, prefix, lambda b: _status(b, model or []))


async def _status(broker: Backend, models: list[str]) -> None:
    for name in models or await broker.queue.models():
        stats = await broker.queue.stats(name)
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
        for info in await broker.registry.workers(name):
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


app.command("bench")(bench)
app.command("autoscale")(autoscale)
app.command("audit")(audit)
app.command("worker-ready")(worker_ready)
app.add_typer(config_app, name="config")
app.add_typer(keys_app, name="keys")
app.add_typer(tenants_app, name="tenants")
app.add_typer(batch_app, name="batch")


def main() -> None:
    try:
        app()
    except FatalError as exc:  # misconfiguration: one line, no traceback
        print(f"tokenyard: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
