"""Engines that step sequences: a cost-model simulator, transformers (continuous or static),
vLLM's AsyncLLM and a remote OpenAI-compatible server."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec

from tokenyard.engines.base import (
    Engine,
    EngineCapacity,
    EngineRequest,
    EngineTokenizer,
    StepOutput,
)
from tokenyard.engines.models import parse_loras, served_names
from tokenyard.messages import EngineStats

if TYPE_CHECKING:
    from tokenyard.config import WorkerSettings

ENGINE_NAMES = ("sim", "hf", "hf-static", "hf-embed", "vllm", "remote")
log = logging.getLogger(__name__)
# what the embeddings engine takes of the hf engine's options (`make_engine("hf", ...)` builds it
# for a model directory with no generative head)
_EMBED_OPTIONS = (
    "model",
    "device",
    "dtype",
    "threads",
    "max_seqs",
    "max_tokens",
    "max_batch_tokens",
)
STATIC_BATCH_SIZE = 32  # hf-static's batch when max_seqs is not set

__all__ = [
    "ENGINE_NAMES",
    "Engine",
    "EngineCapacity",
    "EngineRequest",
    "EngineStats",
    "EngineTokenizer",
    "StepOutput",
    "build_engine",
    "engine_options",
    "make_engine",
]


def make_engine(name: str, **options: Any) -> Engine:
    """Build an engine by name: "sim", "hf" (model path or "tiny"), "hf-static", "hf-embed"
    (embeddings; "hf" picks it for an embedding model's directory), "vllm" or "remote".

    torch/transformers are imported only for the hf engines.
    """
    if name == "sim":
        from tokenyard.engines.sim import SimEngine

        return SimEngine(**options)
    if name == "hf-embed" or (name == "hf" and _embeds(options.get("model"))):
        from tokenyard.engines.hf_embed import HFEmbedEngine

        return HFEmbedEngine(**{k: v for k, v in options.items() if k in _EMBED_OPTIONS})
    if name == "hf":
        from tokenyard.engines.hf import HFEngine

        return HFEngine(**options)
    if name == "hf-static":
        from tokenyard.engines.hf_static import HFStaticEngine

        return HFStaticEngine(**options)
    if name == "vllm":
        from tokenyard.engines.vllm import VLLMEngine

        return VLLMEngine(**options)
    if name == "remote":
        from tokenyard.engines.remote import RemoteEngine

        return RemoteEngine(**options)
    raise ValueError(f"unknown engine {name!r}; expected one of {', '.join(ENGINE_NAMES)}")


def _embeds(model: Any) -> bool:
    if model is None:
        return False
    from tokenyard.engines.pooling import is_embedding_model

    return is_embedding_model(model)


def engine_options(settings: WorkerSettings) -> dict[str, Any]:
    """The engine's constructor arguments from worker settings; None leaves the engine's default
    (sized from the device) in place."""
    if settings.engine in ("vllm", "remote"):
        options: dict[str, Any] = served_engine_options(settings)
    elif settings.engine == "sim":
        options = {
            "max_seqs": settings.max_seqs,
            "max_tokens": settings.token_budget,
            "prefix_cache_tokens": settings.sim_prefix_cache_tokens or None,
            "prefill_base": settings.sim_prefill_base_s,
            "prefill_per_token": settings.sim_prefill_per_token_s,
            "decode_base": settings.sim_decode_base_s,
            "decode_per_seq": settings.sim_decode_per_seq_s,
        }
    else:
        options = {
            "model": settings.model,
            "device": settings.device,
            "dtype": settings.dtype,
            "threads": settings.threads,
            "max_tokens": settings.token_budget,
        }
        if settings.engine == "hf-embed":
            options |= {
                "max_seqs": settings.max_seqs,
                "max_batch_tokens": settings.max_batch_tokens,
            }
        elif settings.engine == "hf-static":
            # A batch as large as the worker may hold; the engine queues one more behind it.
            options["batch_size"] = settings.max_seqs or STATIC_BATCH_SIZE
        else:
            options |= {
                "max_seqs": settings.max_seqs,
                "max_batch_tokens": settings.max_batch_tokens,
                "kv_cache_memory_fraction": settings.kv_cache_memory_fraction,
                "cuda_graphs": settings.cuda_graphs,
                "warmup": settings.warmup,
                **_lora_options(settings),
            }
    return {k: v for k, v in options.items() if v is not None}


def build_engine(settings: WorkerSettings) -> Engine:
    """The engine a worker's settings describe (`auto`: see engines/auto.py), in its own process
    when `engine_process` is set."""
    if settings.engine == "auto":
        from tokenyard.engines.auto import auto_engine

        choice = auto_engine(settings.model, settings.device)
        log.info("engine %s (auto: %s)", choice.engine, choice.reason)
        settings = msgspec.structs.replace(settings, engine=choice.engine)
    if settings.engine_process:
        from tokenyard.engines.process import ProcessEngine

        return ProcessEngine(settings.engine, engine_options(settings))
    return make_engine(settings.engine, **engine_options(settings))


def _lora_options(settings: WorkerSettings) -> dict[str, Any]:
    # the adapters a worker serves (`--lora`), alike for the engines that take them
    return {
        "loras": parse_loras(settings.loras) or None,
        "max_loras": settings.max_loras if settings.loras else None,
    }


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
            **_lora_options(settings),
        }
    if settings.engine == "remote":
        return {
            "model": settings.model,
            "url": settings.remote_url,
            # asked of the upstream by the name this worker serves it under, unless told
            "upstream_model": settings.remote_model
            or served_names(settings.model, settings.served_model_name)[0],
            "concurrency": settings.remote_concurrency,
            "api_key": settings.remote_api_key,
            "retries": settings.remote_retries,
            "timeout_s": settings.remote_timeout_s,
        }
    raise ValueError(f"engine {settings.engine!r} is neither vllm nor remote")
