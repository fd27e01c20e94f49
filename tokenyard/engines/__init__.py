"""Engines that step sequences: a cost-model simulator and transformers (continuous or static)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenyard.engines.base import (
    Engine,
    EngineCapacity,
    EngineClosed,
    EngineStats,
    EngineTokenizer,
    StepOutput,
)

if TYPE_CHECKING:
    from tokenyard.config import WorkerSettings

ENGINE_NAMES = ("sim", "hf", "hf-static")
STATIC_BATCH_SIZE = 32  # hf-static's batch when max_seqs is not set

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineCapacity",
    "EngineClosed",
    "EngineStats",
    "EngineTokenizer",
    "StepOutput",
    "build_engine",
    "engine_options",
    "make_engine",
]


def make_engine(name: str, **options: Any) -> Engine:
    """Build an engine by name: "sim", "hf" (model path or "tiny") or "hf-static".

    torch/transformers are imported only for the hf engines.
    """
    if name == "sim":
        from tokenyard.engines.sim import SimEngine

        return SimEngine(**options)
    if name == "hf":
        from tokenyard.engines.hf import HFEngine

        return HFEngine(**options)
    if name == "hf-static":
        from tokenyard.engines.hf_static import HFStaticEngine

        return HFStaticEngine(**options)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINE_NAMES)}")


def engine_options(settings: WorkerSettings) -> dict[str, Any]:
    """The engine's constructor arguments from worker settings; None leaves the engine's default
    (sized from the device) in place."""
    if settings.engine == "sim":
        options: dict[str, Any] = {
            "max_seqs": settings.max_seqs,
            "max_tokens": settings.token_budget,
        }
    else:
        options = {
            "model": settings.model,
            "device": settings.device,
            "dtype": settings.dtype,
            "threads": settings.threads,
            "max_tokens": settings.token_budget,
        }
        if settings.engine == "hf-static":
            # A batch as large as the worker may hold; the engine queues one more behind it.
            options["batch_size"] = settings.max_seqs or STATIC_BATCH_SIZE
        else:
            options |= {
                "max_seqs": settings.max_seqs,
                "max_batch_tokens": settings.max_batch_tokens,
                "kv_cache_memory_fraction": settings.kv_cache_memory_fraction,
                "cuda_graphs": settings.cuda_graphs,
                "warmup": settings.warmup,
            }
    return {k: v for k, v in options.items() if v is not None}


def build_engine(settings: WorkerSettings) -> Engine:
    """The engine a worker's settings describe, in its own process when `engine_process` is set."""
    if settings.engine_process:
        from tokenyard.engines.process import ProcessEngine

        return ProcessEngine(settings.engine, engine_options(settings))
    return make_engine(settings.engine, **engine_options(settings))
