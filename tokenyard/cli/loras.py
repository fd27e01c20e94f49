"""`tokenyard lora add|list|rm`: LoRA adapters in the broker's directory, served by every
gateway under their names and loaded by every worker of their base model (as POST
/admin/loras does)."""

from __future__ import annotations

import time
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from tokenyard.cli.options import BrokerOpt, PrefixOpt, with_broker
from tokenyard.errors import FatalError
from tokenyard.messages import AdapterRecord

lora_app = typer.Typer(no_args_is_help=True, help="LoRA adapters served on a base model.")
console = Console()


@lora_app.command("add")
def lora_add(
    name: Annotated[str, typer.Argument(help="the model name requests give to use it")],
    path: Annotated[str, typer.Argument(help="a PEFT adapter directory or hub id")],
    model: Annotated[str, typer.Option(help="the base model it runs on (its served name)")],
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Add (or replace) an adapter for every worker of MODEL."""
    record = AdapterRecord(name=name, base=model, path=path, created_at=time.time())
    with_broker(broker, prefix, lambda b: b.directory.put_adapter(record))
    console.print(f"LoRA adapter {name} on {model}: {path}", highlight=False)


@lora_app.command("list")
def lora_list(broker: BrokerOpt = None, prefix: PrefixOpt = None) -> None:
    """Adapters by name: base model, path."""
    records = with_broker(broker, prefix, lambda b: b.directory.adapters())
    table = Table("name", "model", "path")
    for record in records:
        table.add_row(record.name, record.base, record.path)
    console.print(table)


@lora_app.command("rm")
def lora_rm(
    name: Annotated[str, typer.Argument(help="the adapter's name")],
    broker: BrokerOpt = None,
    prefix: PrefixOpt = None,
) -> None:
    """Stop serving an adapter (jobs already queued with it still run)."""
    if not with_broker(broker, prefix, lambda b: b.directory.delete_adapter(name)):
        raise FatalError(f"no LoRA adapter named {name!r}")
    console.print(f"LoRA adapter {name} removed", highlight=False)
