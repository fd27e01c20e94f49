"""CUDA graphs of a served batch's shapes, captured before the first request.

transformers' continuous batching replays one CUDA graph per step shape: the step's query tokens
padded up to a multiple of `q_padding_interval_size`, its KV tokens read padded likewise, and
the longest sequence's key length padded to a power of two (at least 1024). A shape is captured
the first time a step has it, and a capture stalls the whole batch for tens of milliseconds. A
served batch meets many query sizes (requests arrive a few per step, each adding its prompt to
the decodes), so on a GPU the first minutes of traffic paid for a capture every few steps.
(`manager.warmup()` captures two shapes into the processor that sizes the cache, not into the
one the generation loop makes and steps with: those do not carry over.)

`capture_query_buckets` captures, on the generation thread before its first step, the graph of
every query bucket for short sequences (key length up to 1024), steps of many prompts and
decodes as a server's are; longer sequences' shapes are still captured when first met. It uses
manager internals, as `tokenyard.engines.hf` does (checked against transformers 5.24); a shape
that fails to capture is logged and left for the first step that has it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.utils import pad_to_pow2

try:  # transformers 5.23 moved it here from utils, which 5.24 no longer has
    from transformers.generation.continuous_batching.requests import (
        create_warmup_future_states,
    )
except ImportError:  # pragma: no cover - older transformers (vLLM pins its own)
    from transformers.generation.continuous_batching.utils import (
        create_warmup_future_states,
    )

log = logging.getLogger(__name__)

# The shortest key length a graph is keyed by (transformers pads up to this power of two).
SHORT_KEYS = 1024
# Tokens of each fake request: a prompt's worth, so that a bucket's requests stay short.
_PER_REQUEST = 64


@torch.no_grad()
def capture_query_buckets(processor: Any, model: Any) -> int:
    """Capture into `processor` (a continuous-batching processor, before its first step) the
    graph of every query bucket up to its token limit, for sequences shorter than `SHORT_KEYS`;
    returns how many were captured."""
    runner = processor.model_runner
    if not runner.pad_inputs or not runner.use_cuda_graph_varlen:
        return 0
    cache = runner.cache
    io = runner.inputs_and_outputs
    if not hasattr(io, "max_length_k"):  # asynchronous batching keeps a pair: not warmed here
        return 0
    step = int(runner.cb_config.q_padding_interval_size)
    # history enough that each request fills one page: the largest bucket fits a small cache
    past = max(1, int(runner.cb_config.page_size) - _PER_REQUEST)
    started = time.perf_counter()
    captured = 0
    try:
        for q in range(step, int(cache.max_batch_tokens) + 1, step):
            if not _capture(runner, model, q, past):
                break
            captured += 1
    except Exception as exc:  # the shapes left are captured by the first steps that have them
        log.warning("capturing the CUDA graphs of query buckets stopped: %s", exc)
    cache.reset()
    log.info(
        "captured %d CUDA graphs of query buckets up to %d tokens in %.1f s",
        captured,
        cache.max_batch_tokens,
        time.perf_counter() - started,
    )
    return captured


def _capture(runner: Any, model: Any, q: int, past: int) -> bool:
    """Capture the bucket of `q` query tokens, spread over short requests of `past` tokens of
    history each; False when the cache cannot hold them (nor then any larger bucket)."""
    cache, io = runner.cache, runner.inputs_and_outputs
    requests = -(-q // _PER_REQUEST)
    states = create_warmup_future_states(
        requests, RequestStatus.PREFILLING, q // requests, past, cache
    )
    try:
        if len(states) < requests:
            return False
        padded_q, padded_kv = runner.maybe_pad_inputs(
            num_q_tokens=sum(fs.query_length for fs in states),
            max_kv_read=past * requests,
            use_decode_fast_path=False,
        )
        io.prepare_batch_tensors(
            states, runner.logit_processor, False, padded_q, padded_kv, use_padding=True
        )
        batch = io.get_model_kwargs(use_padding=True)
        for allocator in cache.cache_allocators.values():
            keys = allocator.get_seqlen_k(past, q // requests)
            keys = pad_to_pow2(keys, cache.max_tokens_read, SHORT_KEYS)
            batch["max_length_k"][allocator.layer_type] = keys
            io.max_length_k[allocator.layer_type] = keys
        if io.get_graph() is None:
            runner.compute_batch(model, batch)
        if io.compute_stream is not None:
            io.compute_stream.synchronize()  # the next bucket rewrites the static inputs
        return True
    finally:
        for fs in states:
            cache.free_blocks(fs.state.request_id)
