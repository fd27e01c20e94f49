"""The command line; its help names every command (`_name_commands`)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from prometheus_client import CollectorRegistry
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tokenyard.broker import AMQP_SCHEMES, Backend, check_url, redacted
from tokenyard.cli import ops
from tokenyard.cli.audit import audit
from tokenyard.cli.autoscale import autoscale, worker_ready
from tokenyard.cli.batch import app as batch_app
from tokenyard.cli.bench import bench
from tokenyard.cli.config import config_app, warn_unknown_variables
from tokenyard.cli.engine import (
    EngineOpt,
    GatewayEngineOpt,
    SimDecodeBaseOpt,
    SimDecodePerSeqOpt,
    SimPrefillBaseOpt,
    SimPrefillPerTokenOpt,
    engine_choice,
    export_loras,
    export_to_workers,
    sim_cost,
)
from tokenyard.cli.failures import DEBUG_ENV, report_failure
from tokenyard.cli.options import (
    AuditKafkaOpt,
    BrokerOpt,
    PrefixOpt,
    TablesOpt,
    base_url,
    broker_settings,
    check_reachable,
    gateway_target,
    with_broker,
)
from tokenyard.config import (
    CONFIG_ENV,
    SECTIONS,
    BrokerSettings,
    WorkerSettings,
    from_env,
    setting_sources,
)
from tokenyard.engines.models import parse_loras
from tokenyard.errors import FatalError, TokenyardError
from tokenyard.fleet.local import (
    DATA_DIR_ENV,
    RECORD,
    LocalServe,
    check_free,
    forget,
    hold,
    record,
)
from tokenyard.logs import Fields, LogFormat, json_logging, setup_logging

if TYPE_CHECKING:
    from tokenyard.gateway.settings import GatewaySettings
from tokenyard.cli.loras import lora_app
from tokenyard.cli.tenants import keys_app, tenants_app

# --debug's tracebacks leave out local variables: they may hold API keys and broker passwords
app = typer.Typer(
    no_args_is_help=True, add_completion=False, help=__doc__, pretty_exceptions_show_locals=False
)
console = Console()
log = logging.getLogger("tokenyard.serve")

ModelOpt = Annotated[
    str | None,
    typer.Option(
        help="a model directory, a Hugging Face id (org/name: fetched into the Hugging Face "
        "cache; HF_HUB_OFFLINE=1: the cache only), or `tiny`"
    ),
]
LoraOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        help="a LoRA adapter served on the model, NAME=PATH (a PEFT directory or hub id; repeat "
        "for more): `model: NAME` runs the model with it (vLLM's --lora-modules)",
    ),
]
MaxLorasOpt = Annotated[
    int | None,
    typer.Option("--max-loras", help="LoRA adapters resident per worker (LRU); default 4"),
]
ServedNameOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--served-model-name",
        help="the model's name in the API (repeat, or a comma list, for aliases; the first is "
        "the one answers carry); default: --model as given",
    ),
]
RevisionOpt = Annotated[
    str | None, typer.Option(help="a Hugging Face id's branch, tag or commit; default main")
]
LogFormatOpt = Annotated[
    LogFormat, typer.Option(envvar="TOKENYARD_LOG_FORMAT", help="text | json (one object a line)")
]
LogLevelOpt = Annotated[
    str,
    typer.Option(
        envvar="TOKENYARD_LOG_LEVEL",
        help="INFO: a line per request and a worker's stats; WARNING: neither; DEBUG: probes too",
    ),
]


# the commands that set their log lines up first, then warn of unknown variables in them
_LOGGING = ("serve", "gateway", "worker")


@app.callback()
def _options(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar=CONFIG_ENV,
            # escaped: rich would take the tables' names for markup and print none of them
            help=escape(f"TOML file with {' '.join(f'[{t}]' for t in SECTIONS)} tables; ")
            + "flags > env > file",
        ),
    ] = None,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug", envvar=DEBUG_ENV, help="a failure prints its traceback, not one line"
        ),
    ] = False,
) -> None:
    if config is not None:
        # every settings lookup reads it from here, and serve's worker processes inherit it
        os.environ[CONFIG_ENV] = str(config)
    if debug:
        os.environ[DEBUG_ENV] = "1"  # for main() below, and serve's workers
    if ctx.invoked_subcommand not in _LOGGING:
        warn_unknown_variables()


ServeBrokerOpt = Annotated[
    str | None,
    typer.Option(
        "--broker",
        help="a broker URL (redis://, nats://, amqp://...), or `nats` / `valkey` for a private "
        "server in --data-dir; default: TOKENYARD_BROKER_URL, else a private Valkey",
    ),
]


ToolCallParserOpt = Annotated[
    str | None,
    typer.Option(
        help="how chat answers' tool calls are read: hermes, llama3_json, mistral, or auto "
        "(the one the model's chat template shows); default TOKENYARD_GATEWAY_TOOL_CALL_PARSER"
        ", else auto",
    ),
]


ReasoningParserOpt = Annotated[
    str | None,
    typer.Option(
        help="how chat answers' reasoning is split from their content: deepseek_r1 or qwen3 "
        "(vLLM's names); default TOKENYARD_GATEWAY_REASONING_PARSER, else none",
    ),
]


@app.command()
def serve(
    broker: ServeBrokerOpt = None,
    tables: TablesOpt = None,
    prefix: PrefixOpt = None,
    model: ModelOpt = None,
    served_model_name: ServedNameOpt = None,
    revision: RevisionOpt = None,
    engine: EngineOpt = None,
    host: Annotated[str | None, typer.Option(help="gateway address")] = None,
    port: Annotated[int | None, typer.Option(help="gateway port")] = None,
    tool_call_parser: ToolCallParserOpt = None,
    reasoning_parser: ReasoningParserOpt = None,
    workers: Annotated[str, typer.Option(help="worker processes, or `auto`")] = "1",
    max_seqs: Annotated[int | None, typer.Option(help="sequences per worker")] = None,
    lora: LoraOpt = None,
    max_loras: MaxLorasOpt = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            envvar=DATA_DIR_ENV,
            help="the private server's data, and serve.json, by which the other commands "
            "find this serve; default .tokenyard/valkey or /nats",
        ),
    ] = None,
    min_workers: Annotated[int | None, typer.Option("--min", help="auto: warm pool")] = None,
    max_workers: Annotated[int | None, typer.Option("--max", help="auto: most workers")] = None,
    audit_kafka: AuditKafkaOpt = None,
    log_format: LogFormatOpt = LogFormat.TEXT,
    log_level: LogLevelOpt = "INFO",
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
    from tokenyard.engines import ENGINE_NAMES
    from tokenyard.engines.auto import AUTO
    from tokenyard.fleet.ready import wait_ready
    from tokenyard.fleet.serve import EMBEDDED, Stack
    from tokenyard.worker.run import with_local_model

    setup_logging(log_level, log_format)
    warn_unknown_variables()
    settings = broker_settings(
        broker, prefix, required=False, tables=tables, audit_kafka=audit_kafka
    )
    # a URL named anywhere (flag, env, file) is used; a bare `nats` / `valkey`, or nothing,
    # names the private server serve runs itself
    private = next((kind for kind in EMBEDDED if kind == (settings.url or "valkey")), None)
    if private is None:
        check_url(settings.url)
        if settings.tables_url or not settings.url.startswith(AMQP_SCHEMES):
            check_reachable(settings)  # (amqp:// lanes' tables on a Valkey serve starts: later)
    sim = sim_cost(
        sim_prefill_base_s, sim_prefill_per_token_s, sim_decode_base_s, sim_decode_per_seq_s
    )
    worker_settings = _worker_settings(
        model, served_model_name, revision, engine, max_seqs, lora, max_loras, **sim
    )
    if worker_settings.engine not in (*ENGINE_NAMES, AUTO):  # before any process starts
        names = ", ".join((AUTO, *ENGINE_NAMES))
        raise FatalError(f"unknown engine {worker_settings.engine!r}; expected one of {names}")
    data_dir = data_dir or Path(".tokenyard", private or "valkey")
    check_free(data_dir)  # one serve per data dir: a second stops here, naming the first
    named = worker_settings.model
    # resolved (a hub id fetched) once, here: every worker loads the same snapshot, and the
    # gateway its tokenizer, under the names the model is served by
    worker_settings = with_local_model(worker_settings)
    export_to_workers(sim)
    export_loras(worker_settings.loras, max_loras)
    # decided once here, so every worker runs the engine the start line names
    chosen = engine_choice(worker_settings, engine)
    auto = autoscale_config(workers, min_workers, max_workers)
    gw = _gateway_settings(
        (worker_settings.model,),
        chosen.engine,
        host,
        port,
        tool_call_parser,
        reasoning_parser,
        served_model_name=worker_settings.served_model_name,
    )
    # the port before anything starts: one that is taken fails serve at once, in one line
    listener = _bind(gw.host, gw.port)
    stack = Stack(
        given=settings,
        external=settings if private is None else None,
        embedded=private or "valkey",
        model=worker_settings.model,
        served_names=worker_settings.served_model_name,
        engine=chosen.engine,
        n_workers=0 if auto else int(workers),
        max_seqs=worker_settings.max_seqs,
        data_dir=data_dir,
        autoscale=auto,
        log_format=log_format,
        log_level=log_level,
    )
    # uvicorn re-raises the SIGTERM it handled once it has shut down: turn it into an exit
    # that unwinds the stack (workers drain, the private server stops) instead of killing it
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        with hold(data_dir), stack:
            started = LocalServe(
                pid=os.getpid(),
                started_at=time.time(),
                broker_url=stack.broker_url,
                tables_url=stack.tables_url,
                prefix=settings.prefix,
                api_url=base_url(gw.host, listener.getsockname()[1]),
                model=worker_settings.served_model_name[0],
                engine=chosen.engine,
                workers=workers,
            )
            record(data_dir, started)

            async def announce() -> None:
                # the banner once the model is known good: a worker loaded it and answers
                need_workers = auto is None or auto.min_workers > 0
                live = await wait_ready(started.api_url, workers=need_workers)
                _print_started(started, named, data_dir, private, chosen.reason)
                ready = ",".join(f"{m}:{n}" for m, n in live.items()) or None
                log.info(Fields("ready", {"api": f"{started.api_url}/v1", "workers": ready}))

            try:
                _run_gateway(stack.broker_settings, gw, stack.registry, listener, announce)
            finally:
                forget(data_dir)
    finally:
        if stack.failure is not None:  # a worker stopped serve: say why, exit non-zero
            raise FatalError(stack.failure)


def _worker_settings(
    model: str | None,
    served_model_name: list[str] | None,
    revision: str | None,
    engine: str | None,
    max_seqs: int | None,
    lora: list[str] | None,
    max_loras: int | None,
    **more: Any,
) -> WorkerSettings:
    """A worker's settings from the model flags serve and worker share, and `more` of its
    own (None: not given): flags, then TOKENYARD_WORKER_*, then the config file, then defaults."""
    return from_env(
        WorkerSettings,
        "worker",
        model=model,
        served_model_name=_names(served_model_name),
        revision=revision,
        engine=engine,
        max_seqs=max_seqs,
        loras=_loras(lora),
        max_loras=max_loras,
        **more,
    )


def _names(served_model_name: list[str] | None) -> tuple[str, ...] | None:
    """--served-model-name's values as settings take them; None: not given."""
    return tuple(served_model_name) if served_model_name else None


def _loras(given: list[str] | None) -> tuple[str, ...] | None:
    """--lora entries, checked now (NAME=PATH each); None: the environment's, if any."""
    if not given:
        return None
    parse_loras(given)
    return tuple(given)


def _bind(host: str, port: int) -> socket.socket:
    """The gateway's listening socket, bound now (uvicorn listens on it later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        taken = exc.errno == errno.EADDRINUSE
        why = "is taken (another server listens there)" if taken else f"cannot be bound: {exc}"
        raise FatalError(f"{host}:{port} {why}; pick another with --port") from exc
    return sock


def _print_started(
    serve: LocalServe, named: str, data_dir: Path, private: str | None, why: str
) -> None:
    """What serve started and where (`named`: the model as --model named it; `why`: why this
    engine), before it serves."""
    api = serve.api_url
    n = "auto" if serve.workers == "auto" else serve.workers
    where = f"private {private} in {data_dir}" if private else "given"
    model = serve.model if named == serve.model else f"{serve.model} ({named})"
    lines = [
        f"[bold]tokenyard serve[/] · model {model} · engine {serve.engine} ({why}) · workers {n}",
        f"  API        {api}/v1",
        f"  dashboard  {api}/dashboard",
        f"  metrics    {api}/metrics",
        f"  docs       {api}/docs",
        f"  broker     {redacted(serve.broker_url)} ({where})",
    ]
    if serve.tables_url:
        lines.append(f"  tables     {redacted(serve.tables_url)}")
    lines.append(f"other commands here find it by {data_dir / RECORD} · Ctrl-C stops")
    if json_logging():  # the same, as one line of the JSON stream
        where_to = {"api": f"{api}/v1", "dashboard": f"{api}/dashboard", "docs": f"{api}/docs"}
        log.info(
            Fields(
                "tokenyard serve",
                {"model": serve.model, "engine": serve.engine, "why": why, "workers": n}
                | where_to
                | {"broker": redacted(serve.broker_url), "record": str(data_dir / RECORD)},
            )
        )
        return
    for line in lines:
        console.print(line, highlight=False)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _gateway_settings(
    models: str | tuple[str, ...] | None,
    engine: str | None,
    host: str | None,
    port: int | None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    *,
    served_model_name: tuple[str, ...] | None = None,
    revision: str | None = None,
) -> GatewaySettings:
    """Flags, then TOKENYARD_GATEWAY_*, then the config file, then defaults; the tokenizer
    family follows the workers' engine (flag, env or file) unless the gateway's is set."""
    from tokenyard.gateway.settings import GatewaySettings, gateway_settings

    tokenizer = None
    workers = setting_sources(WorkerSettings, "worker", engine=engine)
    if "engine" in workers and "tokenizer" not in setting_sources(GatewaySettings, "gateway"):
        tokenizer = "sim" if workers["engine"][0] == "sim" else "hf"
    return gateway_settings(
        models=models,
        served_model_name=served_model_name or None,
        revision=revision,
        host=host,
        port=port,
        tokenizer=tokenizer,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )


def _run_gateway(
    broker_settings: BrokerSettings,
    settings: GatewaySettings,
    registry: CollectorRegistry | None = None,
    listener: socket.socket | None = None,
    on_started: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> None:
    """Serve the gateway until stopped; `on_started` runs on its loop once it listens."""
    import uvicorn

    from tokenyard import tracing
    from tokenyard.gateway.app import create_app
    from tokenyard.gateway.settings import served_models
    from tokenyard.gateway.tokenizers import load_tokenizers

    listener = listener or _bind(settings.host, settings.port)
    tracing.configure("tokenyard-gateway")
    # loaded here rather than in the app's startup: a model that is not there fails the
    # command in one line, where uvicorn would log a traceback and exit 3
    tokenizers = load_tokenizers(settings)
    gateway_app = create_app(
        settings,
        broker_settings=broker_settings,
        tokenizers=tokenizers,
        registry=registry,
        freeze_heap=True,
    )

    class Server(uvicorn.Server):
        announcing: asyncio.Task[None] | None = None

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:  # listening: the one line that says so (uvicorn's are WARNING+)
                logging.getLogger("tokenyard.gateway").info(
                    "gateway started on http://%s:%d: models %s, broker %s",
                    settings.host,
                    settings.port,
                    ",".join(served_models(settings).names),
                    redacted(broker_settings.url),
                )
                if on_started is not None:
                    self.announcing = asyncio.get_running_loop().create_task(on_started())

    # tokenyard logs each request itself (gateway/instrument.py), so uvicorn's access log is
    # off; log_config=None sends uvicorn's own lines through our handler and format
    config = uvicorn.Config(
        gateway_app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        log_config=None,
    )
    server = Server(config)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: a clean stop
        pass
    except SystemExit as exc:
        if exc.code in (0, None):  # a signal's clean stop (`_exit_on_signal`)
            raise
        # uvicorn's way to say the app's startup failed (it logged why)
        raise FatalError(f"the gateway did not start (uvicorn exit {exc.code})") from exc
    finally:
        tracing.shutdown()
        listener.close()
    if not server.started:
        raise FatalError("the gateway did not start (its startup failed; see the lines above)")


@app.command()
def gateway(
    broker: BrokerOpt = None,
    tables: TablesOpt = None,
    prefix: PrefixOpt = None,
    model: Annotated[
        str | None,
        typer.Option(
            help="models served (comma list): directories, Hugging Face ids (org/name, through "
            "its cache) or `tiny`; their tokenizers are loaded"
        ),
    ] = None,
    served_model_name: ServedNameOpt = None,
    revision: RevisionOpt = None,
    engine: GatewayEngineOpt = None,
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    tool_call_parser: ToolCallParserOpt = None,
    reasoning_parser: ReasoningParserOpt = None,
    audit_kafka: AuditKafkaOpt = None,
    log_format: LogFormatOpt = LogFormat.TEXT,
    log_level: LogLevelOpt = "INFO",
) -> None:
    """Run one gateway (OpenAI API) against a shared broker; start as many as you like.

    Options left out come from TOKENYARD_GATEWAY_* / TOKENYARD_BROKER_* variables.
    """
    setup_logging(log_level, log_format)
    warn_unknown_variables()
    _run_gateway(
        broker_settings(broker, prefix, tables=tables, audit_kafka=audit_kafka),
        _gateway_settings(
            model,
            engine,
            host,
            port,
            tool_call_parser,
            reasoning_parser,
            served_model_name=_names(served_model_name),
            revision=revision,
        ),
    )


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="the prompt")],
    url: Annotated[
        str | None,
        typer.Option(
            help="gateway base URL; default: TOKENYARD_GATEWAY_HOST/_PORT, else the local "
            "serve's, else http://127.0.0.1:8000"
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="default: the first of TOKENYARD_GATEWAY_MODELS, else the local serve's"),
    ] = None,
    max_tokens: Annotated[int, typer.Option()] = 64,
    temperature: Annotated[float, typer.Option()] = 0.0,
    chat: Annotated[bool, typer.Option(help="use /v1/chat/completions")] = False,
    api_key: Annotated[str | None, typer.Option(envvar="TOKENYARD_API_KEY")] = None,
) -> None:
    """Send a prompt and stream the answer to the terminal."""
    import httpx

    from tokenyard.cli.submit import stream_completion

    url, model = gateway_target(url, model)
    try:
        code = asyncio.run(
            stream_completion(
                url, model, prompt, max_tokens, temperature, chat, api_key, console.print
            )
        )
    except httpx.ConnectError as exc:
        raise TokenyardError(
            f"no gateway answers at {url} ({exc}); run `tokenyard serve` in this directory, "
            "or give --url or TOKENYARD_GATEWAY_HOST/_PORT"
        ) from exc
    raise typer.Exit(code)


@app.command()
def worker(
    broker: BrokerOpt = None,
    tables: TablesOpt = None,
    prefix: PrefixOpt = None,
    model: ModelOpt = None,
    served_model_name: ServedNameOpt = None,
    revision: RevisionOpt = None,
    engine: EngineOpt = None,
    max_seqs: Annotated[int | None, typer.Option(help="sequences run at once")] = None,
    lora: LoraOpt = None,
    max_loras: MaxLorasOpt = None,
    device: Annotated[str | None, typer.Option(help="cpu | cuda")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads")] = None,
    lease_s: Annotated[float | None, typer.Option(help="visibility timeout")] = None,
    drain_timeout_s: Annotated[float | None, typer.Option(help="SIGTERM grace")] = None,
    consumer: Annotated[str | None, typer.Option(help="consumer name")] = None,
    metrics_port: Annotated[
        int | None, typer.Option(help="serve Prometheus metrics on this port; 0: off")
    ] = None,
    log_level: LogLevelOpt = "INFO",
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
    from tokenyard.worker.run import run_loop, serve_worker

    setup_logging(log_level, log_format)
    warn_unknown_variables()
    settings = _worker_settings(
        model,
        served_model_name,
        revision,
        engine,
        max_seqs,
        lora,
        max_loras,
        device=device,
        threads=threads,
        drain_timeout_s=drain_timeout_s,
        metrics_port=metrics_port,
        **sim_cost(
            sim_prefill_base_s, sim_prefill_per_token_s, sim_decode_base_s, sim_decode_per_seq_s
        ),
    )
    queue = broker_settings(broker, prefix, lease_s=lease_s, tables=tables, audit_kafka=audit_kafka)
    run_loop(serve_worker(queue, settings, consumer=consumer))


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
app.add_typer(lora_app, name="lora")
app.add_typer(tenants_app, name="tenants")
app.add_typer(batch_app, name="batch")
app.add_typer(ops.dlq_app, name="dlq")
app.command("drain")(ops.drain)


def _name_commands() -> None:
    """The root help's first line: every command, as registered (a list kept by hand lost
    seven of them)."""
    names = [
        info.name or (info.callback.__name__ if info.callback else "")
        for info in app.registered_commands
    ]
    names += [info.name or "" for info in app.registered_groups]
    app.info.help = (
        f"`tokenyard {' | '.join(n.replace('_', '-') for n in names if n)}`: an LLM server "
        "on a durable job queue. `tokenyard COMMAND --help` tells more."
    )


_name_commands()


def main() -> None:
    """Run the command; a failure is one line on stderr and a non-zero exit (`--debug`: the
    traceback too)."""
    args = sys.argv[1:]
    end = args.index("--") if "--" in args else len(args)
    if "--debug" in args[:end]:  # after the command too (`tokenyard status --debug`)
        args.remove("--debug")
        os.environ[DEBUG_ENV] = "1"
    try:
        app(args=args)
    except SystemExit as exc:
        worker = sys.modules.get("tokenyard.worker.run")  # loaded where a worker ran
        if exc.code in (0, None) and worker is not None:
            worker.exit_if_drained()
        raise
    except Exception as exc:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        report_failure(exc)
        # 2: misconfiguration, as for a bad flag; 1: anything else
        raise SystemExit(2 if isinstance(exc, FatalError) else 1) from None


if __name__ == "__main__":
    main()
