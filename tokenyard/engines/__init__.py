"""Engines that step sequences: a cost-model simulator, transformers (continuous or static),
vLLM's AsyncLLM and a remote OpenAI-compatible server."""

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

ENGINE_NAMES = ("sim", "hf", "hf-static", "vllm", "remote")

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
    if name == "vllm":
        from tokenyard.engines.vllm import VLLMEngine

        return VLLMEngine(**options)
    if name == "remote":
        from tokenyard.engines.remote import RemoteEngine

        return RemoteEngine(**options)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINE_NAMES)}")


def served_engine_options(settings: WorkerSettings) -> dict[str, Any]:
    """Constructor arguments of the vllm and remote engines from the worker's settings."""
    if settings.engine == "vllm":
        return {
            "model": settings.model,
            "dtype": settings.dtype,
            "max_seqs": settings.max_seqs,
            "max_model_len": settings.vllm_max_model_len,
            "max_num_batched_tokens": settings.vllm_max_num_batched_tokens,
            "gpu_memory_utilization": settings.vllm_gpu_memory_utilization,
            "quantization": settings.vllm_quantization,
            "speculative_config": settings.vllm_speculative_config,
            "enable_prefix_caching": settings.vllm_enable_prefix_caching,
            "tensor_parallel_size": settings.vllm_tensor_parallel_size,
            "enforce_eager": settings.vllm_enforce_eager,
            "engine_args": settings.vllm_args,
        }
    if settings.engine == "remote":
        return {
            "model": settings.model,
            "url": settings.remote_url,
            "upstream_model": settings.remote_model,
            "concurrency": settings.remote_concurrency,
            "api_key": settings.remote_api_key,
            "retries": settings.remote_retries,
            "timeout_s": settings.remote_timeout_s,
        }
    raise ValueError(f"engine {settings.engine!r} is neither vllm nor remote")
