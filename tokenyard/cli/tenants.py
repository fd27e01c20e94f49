"""`tokenyard keys create|list|revoke` and `tokenyard tenants set|show`."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Annotated, TypeVar

import msgspec
import typer
from rich.console import Console
from rich.table import Table

from tokenyard.broker.tables import Directory
from tokenyard.cli.options import BrokerOpt, PrefixOpt, with_broker
from tokenyard.messages import Priority
from tokenyard.tenancy.admin import create_key, revoke_key
from tokenyard.tenancy.limiter import check_period
from tokenyard.tenancy.records import TenantConfig

keys_app = typer.Typer(no_args_is_help=True, help="API keys stored in the broker.")
tenants_app = typer.Typer(no_args_is_help=True, help="Tenants' tiers stored in the broker.")
console = Console()
_T = TypeVar("_T")


def _with_directory(
    broker: str | None, prefix: str | None, job: Callable[[Directory], Awaitable[_T]]
) -> _T:
    """Run `job` on the directory of the broker the options name."""
    return with_broker(broker, prefix, lambda backend: job(backend.directory))


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="the tenant the key acts for")],
    label: Annotated[str, typer.Option(help="a note to recognise the key by")] = "",
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Create a key and print it once: only its SHA-256 is stored."""
    key, record = _with_directory(
        broker, prefix, lambda b: create_key(b, tenant, time.time(), label)
    )
    console.print(f"key id {record.key_id} for tenant {record.tenant}", highlight=False)
    # the key alone on stdout's last line, for scripts: `tokenyard keys create ... | tail -1`
    print(key)


@keys_app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="only this tenant's keys")] = None,
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Keys by id (never the key itself): tenant, label, created, revoked."""
    records = _with_directory(broker, prefix, lambda b: b.api_keys())
    table = Table(title="API keys")
    for column in ("id", "tenant", "label", "created", "revoked"):
        table.add_column(column)
    for r in records:
        if tenant is None or r.tenant == tenant:
            table.add_row(r.key_id, r.tenant, r.label, _when(r.created_at), _when(r.revoked_at))
    console.print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[str, typer.Argument(help="the key's id (from `keys list`) or the key")],
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Revoke a key; every gateway refuses it within its cache time (a second or two)."""
    revoked = _with_directory(broker, prefix, lambda b: revoke_key(b, key_id, time.time()))
    if revoked is None:
        console.print(f"no single active key matches {key_id!r}")
        raise typer.Exit(1)
    console.print(f"revoked key {revoked.key_id} of tenant {revoked.tenant}", highlight=False)


@tenants_app.command("set")
def tenants_set(
    name: Annotated[str, typer.Argument(help="tenant name")],
    priority: Annotated[
        str | None, typer.Option(help="tier: high | normal | low (default and highest lane)")
    ] = None,
    admin: Annotated[
        bool | None, typer.Option("--admin/--no-admin", help="may use fleet routes")
    ] = None,
    weight: Annotated[
        float | None, typer.Option(help="share of a lane against other tenants (by tokens)")
    ] = None,
    rpm: Annotated[int | None, typer.Option(help="requests per minute; 0: unlimited")] = None,
    tpm: Annotated[
        int | None, typer.Option(help="tokens (prompt + max_tokens) per minute; 0: unlimited")
    ] = None,
    max_concurrent: Annotated[
        int | None, typer.Option(help="jobs admitted and not yet finished; 0: unlimited")
    ] = None,
    token_budget: Annotated[
        int | None, typer.Option(help="tokens (prompt + max_tokens) per period; 0: unlimited")
    ] = None,
    budget_period: Annotated[
        str | None, typer.Option(help="the budget's period: day | month (UTC) | seconds")
    ] = None,
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Create or change a tenant; options left out keep their current value."""
    tier: Priority | None = None
    if priority is not None:
        try:
            tier = Priority[priority.upper()]
        except KeyError:
            raise typer.BadParameter(f"unknown priority {priority!r}") from None

    async def job(b: Directory) -> TenantConfig:
        config = await b.tenant(name) or TenantConfig(name=name)
        changes: dict[str, object] = {}
        if tier is not None:
            changes["priority"] = tier
        if admin is not None:
            changes["admin"] = admin
        if weight is not None:
            if weight <= 0:
                raise typer.BadParameter("a weight is > 0")
            changes["weight"] = weight
        asked = {
            "rpm": rpm,
            "tpm": tpm,
            "max_concurrent": max_concurrent,
            "token_budget": token_budget,
        }
        limits: dict[str, object] = {k: v for k, v in asked.items() if v is not None}
        if any(v < 0 for v in asked.values() if v is not None):
            raise typer.BadParameter("limits are >= 0 (0: unlimited)")
        if budget_period is not None:
            try:
                limits["budget_period"] = check_period(budget_period)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
        if limits:
            changes["quota"] = msgspec.structs.replace(config.quota, **limits)
        config = msgspec.structs.replace(config, **changes)
        await b.put_tenant(config)
        return config

    config = _with_directory(broker, prefix, job)
    _print_tenants([config])


@tenants_app.command("show")
def tenants_show(
    name: Annotated[str | None, typer.Argument(help="one tenant; default all")] = None,
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Tenants and their tiers."""

    async def job(b: Directory) -> list[TenantConfig]:
        if name is None:
            return await b.tenants()
        one = await b.tenant(name)
        return [] if one is None else [one]

    configs = _with_directory(broker, prefix, job)
    if name is not None and not configs:
        console.print(f"no tenant {name!r} (its keys act with the defaults: normal, not admin)")
        raise typer.Exit(1)
    _print_tenants(configs)


def _print_tenants(configs: list[TenantConfig]) -> None:
    table = Table(title="tenants")
    columns = ("tenant", "priority", "weight", "admin", "rpm", "tpm", "concurrent", "budget")
    for column in columns:
        table.add_column(column)
    for c in configs:
        q = c.quota
        table.add_row(
            c.name,
            c.priority.name.lower(),
            f"{c.weight:g}",
            "yes" if c.admin else "no",
            *(str(v) if v else "-" for v in (q.rpm, q.tpm, q.max_concurrent)),
            f"{q.token_budget}/{q.budget_period}" if q.token_budget else "-",
        )
    console.print(table)
