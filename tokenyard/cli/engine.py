"""What `serve` and `worker` share about the engine: the sim engine's cost model as flags, and
which engine runs and why (the start line's words)."""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

from tokenyard.config import WorkerSettings, setting_sources
from tokenyard.engines import ENGINE_NAMES
from tokenyard.engines.auto import AUTO, EngineChoice, settled_engine

# every command names the engines alike, from the one list the workers build them by
ENGINE_CHOICES = " | ".join(
    (f"{AUTO} (vllm where installed and it supports the model, else hf)", *ENGINE_NAMES)
)
EngineOpt = Annotated[str | None, typer.Option(help=ENGINE_CHOICES)]
# the gateway runs no engine: the workers' tells it which tokenizers to load (sim's or hf's)
GatewayEngineOpt = Annotated[
    str | None, typer.Option(help=f"the workers' engine, for its tokenizers: {ENGINE_CHOICES}")
]
SimPrefillBaseOpt = Annotated[
    float | None, typer.Option(help="sim: seconds a prefill costs, plus the per-token part")
]
SimPrefillPerTokenOpt = Annotated[
    float | None, typer.Option(help="sim: prefill seconds per prompt token")
]
SimDecodeBaseOpt = Annotated[
    float | None, typer.Option(help="sim: seconds a decode step costs, plus the per-seq part")
]
SimDecodePerSeqOpt = Annotated[
    float | None, typer.Option(help="sim: decode step seconds per sequence in the batch")
]


def sim_cost(
    prefill_base_s: float | None,
    prefill_per_token_s: float | None,
    decode_base_s: float | None,
    decode_per_seq_s: float | None,
) -> dict[str, Any]:
    """The sim flags as WorkerSettings overrides (None: not given)."""
    return {
        "sim_prefill_base_s": prefill_base_s,
        "sim_prefill_per_token_s": prefill_per_token_s,
        "sim_decode_base_s": decode_base_s,
        "sim_decode_per_seq_s": decode_per_seq_s,
    }


def export_to_workers(overrides: dict[str, Any]) -> None:
    """Flags given to `serve` that its worker processes read from the environment they inherit."""
    for name, value in overrides.items():
        if value is not None:
            os.environ[f"TOKENYARD_WORKER_{name.upper()}"] = repr(value)


def export_loras(loras: tuple[str, ...], max_loras: int | None) -> None:
    """`serve`'s --lora / --max-loras for its worker processes (a comma list, as the
    environment writes lists)."""
    if loras:
        os.environ["TOKENYARD_WORKER_LORAS"] = ",".join(loras)
    if max_loras is not None:
        os.environ["TOKENYARD_WORKER_MAX_LORAS"] = str(max_loras)


def engine_choice(settings: WorkerSettings, engine_flag: str | None) -> EngineChoice:
    """The engine these settings run and why: `auto` decided (engines/auto.py), or where it was
    set (`engine_flag`: the --engine given, if any)."""
    source = setting_sources(WorkerSettings, "worker", engine=engine_flag).get("engine")
    where = source[1] if source is not None else None
    return settled_engine(settings.engine, settings.model, settings.device, where)
