"""Engines that step sequences: a cost-model simulator and transformers (continuous or static)."""

from __future__ import annotations

from typing import Any

from tokenyard.engines.base import (
    Engine,
    EngineCapacity,
    EngineClosed,
    EngineStats,
    EngineTokenizer,
    StepOutput,
)

ENGINE_NAMES = ("sim", "hf", "hf-static")

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineCapacity",
    "EngineClosed",
    "EngineStats",
    "EngineTokenizer",
    "StepOutput",
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
        from tokenyard.engines.hf import HFStaticEngine

        return HFStaticEngine(**options)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINE_NAMES)}")
