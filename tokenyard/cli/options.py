"""What the commands that talk to the broker share: its two options and a connection per run."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, NamedTuple, TypeVar

import msgspec
import typer

from tokenyard.broker import Backend, check_url, connect, redacted
from tokenyard.config import BrokerSettings, from_env, setting_sources
from tokenyard.errors import BrokerUnavailable

BrokerOpt = Annotated[
    str | None,
    typer.Option(
        "--broker",
        help="redis://host:port/db, nats://host:port or amqp://user:pass@host:port/vhost; "
        "default: TOKENYARD_BROKER_URL",
    ),
]
TablesOpt = Annotated[
    str | None,
    typer.Option(
        "--tables",
        help="with amqp:// lanes: the Redis/Valkey URL of their tables (records, events, keys, "
        "quotas); default: TOKENYARD_BROKER_TABLES_URL",
    ),
]
PrefixOpt = Annotated[str | None, typer.Option(help="name prefix, to share one Redis or NATS")]
AuditKafkaOpt = Annotated[
    str | None,
    typer.Option(
        "--audit-kafka",
        help="also send the audit trail to kafka://host:9092/topic; default: "
        "TOKENYARD_BROKER_AUDIT_KAFKA",
    ),
]
_T = TypeVar("_T")
PING_TIMEOUT_S = 5.0


def broker_settings(
    broker: str | None,
    prefix: str | None,
    lease_s: float | None = None,
    required: bool = True,
    tables: str | None = None,
    audit_kafka: str | None = None,
) -> BrokerSettings:
    """The flags, then TOKENYARD_BROKER_*, then the config file, then the local `serve`'s
    broker (`fleet/local.py`), then the defaults; a command that needs a broker refuses at once
    when there is none (before it loads a model), and a Kafka audit log URL that is not one."""
    given: dict[str, Any] = {
        "url": broker,
        "prefix": prefix,
        "lease_s": lease_s,
        "tables_url": tables,
        "audit_kafka": audit_kafka,
    }
    settings = from_env(BrokerSettings, "broker", None, **given)
    if required and not settings.url:
        named = setting_sources(BrokerSettings, "broker", None, **given)
        settings = _local_serve_broker(settings, prefix_named="prefix" in named)
    if required:
        check_url(settings.url)
    if settings.audit_kafka:
        from tokenyard.broker.kafka import KafkaTarget

        KafkaTarget.parse(settings.audit_kafka)
    return settings


def _local_serve_broker(settings: BrokerSettings, *, prefix_named: bool) -> BrokerSettings:
    """The running local serve's broker (and its prefix, unless one was given), else no
    broker, which check_url refuses, naming how to give one."""
    from tokenyard.fleet.local import find

    serve = find()
    if serve is None:
        return settings
    prefix = settings.prefix if prefix_named else serve.prefix
    tables = settings.tables_url or serve.tables_url
    return msgspec.structs.replace(settings, url=serve.broker_url, tables_url=tables, prefix=prefix)


class GatewayTarget(NamedTuple):
    url: str  # base URL, http://host:port
    model: str  # the model a request names when the command was given none


def gateway_target(url: str | None = None, model: str | None = None) -> GatewayTarget:
    """Where a client command sends its requests, and the model it asks for: as given, else as
    TOKENYARD_GATEWAY_* or the config file names them, else the local serve's (`fleet/local.py`),
    else the gateway's defaults (http://127.0.0.1:8000, the first default model)."""
    from tokenyard.fleet.local import find
    from tokenyard.gateway.settings import GatewaySettings, gateway_settings, served_models

    if url is not None and model is not None:
        return GatewayTarget(url, model)
    named = setting_sources(GatewaySettings, "gateway")
    local = find()
    gw = gateway_settings()
    if url is None:
        named_url = "host" in named or "port" in named
        url = local.api_url if local and not named_url else base_url(gw.host, gw.port)
    if model is None:
        named_model = {"models", "served_model_name"} & set(named)
        model = local.model if local and not named_model else served_models(gw).models[0]
    return GatewayTarget(url, model)


def base_url(host: str, port: int) -> str:
    """http://host:port to reach a server bound to `host` from this machine."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def with_broker(
    broker: str | None, prefix: str | None, job: Callable[[Backend], Awaitable[_T]]
) -> _T:
    """Run `job` on the broker the options name, connected for it and closed afterwards; a
    broker that does not answer within PING_TIMEOUT_S fails the command, naming it."""
    return _on(broker_settings(broker, prefix), job)


def check_reachable(settings: BrokerSettings) -> None:
    """Fail in one line, before anything starts, when the broker `settings` names does not
    answer."""
    _on(settings, _nothing)


def _on(settings: BrokerSettings, job: Callable[[Backend], Awaitable[_T]]) -> _T:
    async def run() -> _T:
        active = connect(settings)
        try:
            await _reachable(active)
            return await job(active)
        finally:
            await active.close()

    return asyncio.run(run())


async def _nothing(_: Backend) -> None:
    return None


async def _reachable(backend: Backend) -> None:
    # a client may retry its first connect for ever (nats-py does): a command should not hang
    try:
        answered = await asyncio.wait_for(backend.ping(), PING_TIMEOUT_S)
    except TimeoutError:
        answered = False
    if not answered:
        url = redacted(backend.settings.url)
        raise BrokerUnavailable(
            f"no answer from the broker at {url}; is it running? (--broker URL or "
            "TOKENYARD_BROKER_URL names another)"
        )
