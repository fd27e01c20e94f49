"""transformers continuous batching: the CB manager steps whatever tokenyard's scheduler started.

Sampling is tokenyard's own (`sampling.py`), not transformers' sampler, so greedy is exact and
seeded sampling survives a resume. Both engines here implement every optional decoding feature:
penalties, logit_bias and min_tokens by vLLM's formulas, raw logprobs, and structured outputs
compiled by xgrammar (`guide.py`). The paged KV cache and the engine's capacity are sized from
the device: free GPU memory after the weights on CUDA, settings (bounded by RAM) on CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import itertools
import logging
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, Unpack, cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    LogitsProcessorList,
    PretrainedConfig,
)
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import (
    FutureRequestState,
    GenerationOutput,
)
from transformers.utils import logging as hf_logging

from tokenyard.engines.badwords import bad_words_token_ids
from tokenyard.engines.base import (
    EngineCapacity,
    EngineRequest,
    EngineSeq,
    LocalEngine,
    StepOutput,
    open_seq,
    weights_fingerprint,
)
from tokenyard.engines.detok import Delta
from tokenyard.engines.guide import GuideCompiler
from tokenyard.engines.hf_graphs import capture_query_buckets
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path
from tokenyard.engines.lora import LoraSet
from tokenyard.engines.sampling import (
    AdjustBuffers,
    LogprobBuffers,
    RowFeatures,
    process_rows,
    prompt_logprobs,
    sample_keys,
)
from tokenyard.errors import FatalError, InvalidRequest
from tokenyard.messages import (
    EngineStats,
    Feature,
    FinishReason,
    Guide,
    Priority,
    PromptLogprob,
    SamplingParams,
    TokenLogprob,
)

if TYPE_CHECKING:
    from transformers import ContinuousBatchingManager

log = logging.getLogger(__name__)


class CausalLM(Protocol):
    """The part of a transformers causal LM the engines use (its own mixin typing is loose)."""

    generation_config: GenerationConfig

    def generate(self, *args: Any, **kwargs: Any) -> Any: ...

    def init_continuous_batching(
        self,
        generation_config: GenerationConfig | None = None,
        continuous_batching_config: ContinuousBatchingConfig | None = None,
    ) -> ContinuousBatchingManager: ...


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_MAX_ZOMBIES = 4096
_WARMUP_ID = "tokenyard-warmup"
_GIB = 1 << 30

# Per-device defaults. A GPU's KV cache holds hundreds of sequences; 256 is vLLM's default.
CPU_MAX_SEQS = 64
CUDA_MAX_SEQS = 256
# Share of memory for the KV cache: of free GPU memory once the weights are loaded (the rest is
# for activations and our [batch, vocab] sampling temporaries, as transformers reserves), and of
# available RAM on CPU, where it only bounds a budget derived from the context length.
CUDA_KV_FRACTION = 0.8
CPU_KV_FRACTION = 0.25


def resolve_device(device: str) -> torch.device:
    """The device to run on; "auto" is the GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The weights' dtype; "auto" is bfloat16 on CUDA (half the KV bytes) and float32 elsewhere."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def available_ram() -> int:
    """Bytes of RAM the system can give without swapping (MemAvailable), or half of it all."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def kv_in_use(cache: Any) -> float:
    """The share of a paged cache that sequences hold. transformers counts the blocks it keeps,
    unreferenced, for prefix reuse as taken, though any new sequence may have them: an idle
    worker read 60-80 % of its cache in use."""
    free = float(cache.compute_free_capacity(relative=False))
    kept = sum(
        len(allocator.ledger.cached_blocks) * allocator.bytes_per_block
        for allocator in cache.cache_allocators.values()
    )
    total = cache.num_sectors * cache.bytes_per_sector
    return min(1.0, max(0.0, 1.0 - (free + kept) / total)) if total else 0.0


def kv_bytes_per_token(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """KV cache bytes one token takes: layers x 2 (K and V) x kv_heads x head_dim x dtype size."""
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return int(text.num_hidden_layers) * 2 * kv_heads * head_dim * dtype.itemsize


def plan_capacity(
    *,
    kv_tokens: int,
    page_size: int,
    max_model_len: int,
    max_seqs: int | None,
    max_tokens: int | None,
    default_seqs: int,
) -> EngineCapacity:
    """Sequences and token budget that fit a KV cache of `kv_tokens` tokens.

    Every running sequence may leave its last page partly empty, so a page per sequence is set
    aside; the budget defaults to every sequence using the whole context, within the cache. The
    sequences may take up to half the pages that way, or, where a budget is asked for, every
    page the budget leaves: a cache sized as budget + a page per sequence (`_cb_config`) holds
    exactly the sequences it was sized for, however short they are.
    """
    pages = kv_tokens // page_size
    if pages < 2:
        raise FatalError(f"the KV cache holds {kv_tokens} tokens: less than two pages")
    seqs = default_seqs if max_seqs is None else max_seqs
    most = pages // 2
    if max_tokens is not None:
        most = max(most, pages - -(-max_tokens // page_size))
    if seqs > most:
        log.warning("max_seqs %d lowered to %d: that is what the KV cache holds", seqs, most)
        seqs = most
    usable = (pages - seqs) * page_size
    wanted = seqs * max_model_len if max_tokens is None else max_tokens
    if wanted > usable and max_tokens is not None:
        log.warning(
            "token budget %d lowered to %d: that is what the KV cache holds", wanted, usable
        )
    return EngineCapacity(max_seqs=max(1, seqs), max_tokens=min(wanted, usable))


def cuda_batch_tokens(total_memory: int, max_seqs: int) -> int:
    """Tokens per forward pass on a GPU: bigger prefill chunks on bigger devices, and always room
    for one decode token of every running sequence."""
    chunk = 4096 if total_memory >= 40 * _GIB else 2048
    return max(chunk, max_seqs)


# --------------------------------------------------------------------------------------------
# Per-request sampling inside the CB manager
# --------------------------------------------------------------------------------------------

# The per-row arguments, one int32 row each in the manager's argument block: (name, type,
# default). Floats travel bit-cast to int32; noise_seed -1 means greedy.
_ARGS: tuple[tuple[str, type, float], ...] = (
    ("temperature", float, 1.0),
    ("top_k", int, 0),
    ("top_p", float, 1.0),
    ("min_p", float, 0.0),
    ("noise_seed", int, -1),
)


def _as_int32(values: Sequence[float], kind: type) -> torch.Tensor:
    if kind is float:
        return torch.tensor(values, dtype=torch.float32).view(torch.int32)
    return torch.tensor(values, dtype=torch.int32)


# what the decoder (stop token ids, the text switches), the per-row arguments (min_p) or the
# engine (a salt, the prompt's logprobs) handle: a sequence asking only those needs no `RowFeatures`
_OUTSIDE_ROW_FEATURES = frozenset(
    {
        Feature.STOP_TOKEN_IDS,
        Feature.MIN_P,
        Feature.DETOKENIZE,
        Feature.CACHE_SALT,
        Feature.PROMPT_LOGPROBS,
    }
)

# one logprobs entry from the device: (chosen token, its logprob, the top (id, logprob) pairs)
_StepLogprob = tuple[int, float, list[tuple[int, float]]]


class _SamplingProcessors(ContinuousBatchingLogitsProcessorList):
    """tokenyard's sampling as the manager's logits processing: one pass over all arguments.

    Rows whose sequence has `RowFeatures` (penalties, bias, min_tokens, a structured output,
    logprobs) also go through dense per-row buffers filled on the host before the forward pass
    (`prepare_tensor_args`), so the device work keeps fixed shapes and addresses (CUDA graphs).
    Eagerly, a step whose rows use none of them does no extra tensor work; while a CUDA graph is
    captured, everything is recorded, since the graph replays for any later batch.
    """

    def __init__(
        self,
        features: Callable[[str], RowFeatures | None],
        *,
        rows: int,
        vocab: int,
        device: torch.device,
        eager_buffers: bool,
        on_batch: Callable[[list[FutureRequestState]], None] | None = None,
    ) -> None:
        # Not the parent's constructor: it converts transformers processors, and we have none.
        self.logits_processor = LogitsProcessorList()
        self.tensors_required = len(_ARGS)
        self.supported_keys = {name: kind for name, kind, _ in _ARGS}
        self.ignored_keys: set[str] = set()
        self.do_processing = True
        self._features = features
        self._rows, self._vocab, self._device = rows, vocab, device
        # The buffers cost 3 x rows x vocab floats: made on first use, unless a CUDA graph may
        # be captured (it must see them from the start).
        self._adjust: AdjustBuffers | None = None
        self._logprobs: LogprobBuffers | None = None
        if eager_buffers:
            self._adjust, self._logprobs = self._buffers()
        self._adjusting = False  # this step has rows with adjusted logits
        self._logprob_rows: dict[str, int] = {}  # request id -> row, this step
        self._on_batch = on_batch  # told each pass's requests before it runs (LoRA spans)

    def _buffers(self) -> tuple[AdjustBuffers, LogprobBuffers]:
        if self._adjust is None or self._logprobs is None:
            self._adjust = AdjustBuffers(self._rows, self._vocab, self._device)
            self._logprobs = LogprobBuffers(self._rows, self._vocab, self._device)
        return self._adjust, self._logprobs

    def _prepare_features(self, request_ids: list[str]) -> None:
        """Fill the buffers for this step's rows (on the manager thread, before the forward)."""
        adjust: list[tuple[int, RowFeatures]] = []
        logprob_rows: dict[str, int] = {}
        for row, request_id in enumerate(request_ids):
            f = self._features(request_id)
            if f is None:
                continue
            if f.adjusts:
                adjust.append((row, f))
            if f.logprobs is not None:
                logprob_rows[request_id] = row
        self._logprob_rows = logprob_rows
        self._adjusting = bool(adjust)
        if adjust or (self._adjust is not None and self._adjust.dirty):
            self._buffers()[0].fill(adjust)

    def step_logprobs(self) -> dict[str, _StepLogprob]:
        """The last step's logprobs of the rows that asked, by request id (one device read)."""
        if not self._logprob_rows or self._logprobs is None:
            return {}
        rows = self._logprobs.read(max(self._logprob_rows.values()) + 1)
        return {rid: rows[row] for rid, row in self._logprob_rows.items()}

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        for row, (_, kind, default) in enumerate(_ARGS):
            int32_tensor[row].copy_(_as_int32([default], kind).expand_as(int32_tensor[row]))

    def prepare_tensor_args(
        self, requests_in_batch: list[FutureRequestState], arg_storage: torch.Tensor
    ) -> torch.Tensor:
        if self._on_batch is not None:
            self._on_batch(requests_in_batch)
        rows = [r.state for r in requests_in_batch if r.has_new_token]
        self._prepare_features([s.request_id for s in rows])
        if not rows:
            return arg_storage
        n = len(rows)
        for i, (name, kind, default) in enumerate(_ARGS[:-1]):
            values = [s.logit_processor_kwargs.get(name, default) for s in rows]
            arg_storage[i, :n] = _as_int32(values, kind).to(arg_storage.device)
        seeds: list[int | None] = []
        for s in rows:
            seed = s.logit_processor_kwargs.get("noise_seed", -1)
            seeds.append(None if seed < 0 else seed)
        # position_offset already counts this step's query tokens: it is the absolute index of
        # the token being sampled, the same with or without a resume.
        keys = sample_keys(seeds, [s.position_offset for s in rows])
        arg_storage[len(_ARGS) - 1, :n] = torch.tensor(keys, dtype=torch.int32).to(
            arg_storage.device
        )
        return arg_storage

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.Tensor, logits_processor_args: torch.Tensor
    ) -> torch.Tensor:
        args = logits_processor_args[:, : scores.size(0)]
        capturing = scores.is_cuda and torch.cuda.is_current_stream_capturing()
        raw = scores
        if self._adjusting or capturing:
            scores = self._buffers()[0].apply(scores)
        out = process_rows(
            scores,
            temperature=args[0].view(torch.float32),
            top_k=args[1],
            top_p=args[2].view(torch.float32),
            keys=args[4],
            min_p=args[3].view(torch.float32),
        )
        if self._logprob_rows or capturing:
            self._buffers()[1].record(raw, out)
        return out


class _StepRouter(OutputRouter):
    """Hands each step's outputs, as one list, to the engine (on the manager's thread)."""

    def __init__(self, sink: Callable[[list[GenerationOutput]], None]) -> None:
        super().__init__()
        self._sink = sink

    def deliver(self, output: GenerationOutput) -> None:
        self._sink([output])

    def deliver_batch(self, outputs: list[GenerationOutput]) -> None:
        self._sink(list(outputs))


# --------------------------------------------------------------------------------------------
# Shared by both transformers engines
# --------------------------------------------------------------------------------------------


@dataclass(eq=False)
class HFSeq(EngineSeq):
    internal_id: str = ""  # the manager's id: seq_id plus a counter, unique per attempt
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base)
    seen: int = 0  # tokens of the CB output already consumed
    aborted: bool = False
    features: RowFeatures | None = None  # penalties, bias, masks, guide, logprobs: when asked
    # its prompt's logprobs (when asked), computed before its first output, sent with it
    prompt_logprobs: list[PromptLogprob] | None = None
    prompt_logprobs_sent: bool = False
    priority: int = Priority.NORMAL  # its lane's (lower first): orders the prefills not begun


class HFLoadOptions(TypedDict, total=False):
    """How a transformers engine loads its model: `HFEngineBase`'s keyword arguments."""

    device: str
    dtype: str
    attn_implementation: str
    seed: int
    threads: int | None


class HFEngineBase(LocalEngine[HFSeq]):
    """Model and tokenizer loading and request checks shared by both transformers engines."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        device: str = "cpu",
        dtype: str = "auto",
        attn_implementation: str = "sdpa",
        seed: int = 0,
        threads: int | None = None,
    ) -> None:
        super().__init__(EngineCapacity(0, 0))  # each engine plans it once the model is known
        self.model_path = resolve_model_path(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.attn_implementation = attn_implementation
        self.seed = seed
        self.threads = threads
        self.tokenizer: HFTokenizer = load_hf_tokenizer(self.model_path)
        self.config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        # the width of the model's logits (may exceed the tokenizer's vocabulary)
        self.logits_vocab = int(self.config.get_text_config().vocab_size)
        self.model: CausalLM | None = None
        self._started = False
        self._revision: str | None = None
        self._guides: GuideCompiler | None = None
        self._guides_lock = threading.Lock()
        self._lora: LoraSet | None = None  # the adapters, once the model is loaded

    @property
    def revision(self) -> str:
        # once: limits() (and so this) runs on every add; greedy output depends on the
        # numerics too (bf16 and fp32 differ)
        if self._revision is None:
            fingerprint = weights_fingerprint(self.model_path)
            self._revision = f"{self.name}:{fingerprint}:{self.dtype}".replace("torch.", "")
        return self._revision

    def _load_model(self) -> CausalLM:
        if self.threads is not None:
            # Process-wide: small CPU models run faster (and far steadier on a busy host)
            # with few intra-op threads than with one per core.
            torch.set_num_threads(self.threads)
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        loaded = AutoModelForCausalLM.from_pretrained(
            self.model_path,
            dtype=self.dtype,
            attn_implementation=self.attn_implementation,
            local_files_only=True,
        )
        # Module.to moves parameters in place; transformers' wrapper types it too narrowly.
        loaded.to(self.device)  # type: ignore[arg-type]
        loaded.eval()  # type: ignore[no-untyped-call]
        self.model = cast(CausalLM, loaded)
        return self.model

    def _guide_compiler(self) -> GuideCompiler:
        with self._guides_lock:
            if self._guides is None:
                self._guides = GuideCompiler(
                    self.tokenizer.hf,
                    vocab_size=self.logits_vocab,
                    stop_token_ids=self.tokenizer.eos_token_ids,
                )
            return self._guides

    async def ready_for(
        self, params: SamplingParams, adapter: str | None = None, adapter_path: str = ""
    ) -> None:
        # The first guide also builds the compiler (the vocabulary's token table): off the loop.
        if params.guide is not None:
            await asyncio.to_thread(self._precompile, params.guide)
        lora = self._lora
        if adapter is not None and lora is not None and adapter not in lora.resident:
            # a load reads the adapter from disk: off the loop, which steps other jobs' tokens
            await asyncio.to_thread(lora.preload, adapter, adapter_path)

    def _precompile(self, guide: Guide) -> None:
        # what went wrong is remembered with the compilation: add raises it, at once
        with contextlib.suppress(Exception):
            self._guide_compiler().compile(guide, fresh_window=True)

    def _close_locked(self) -> list[StepOutput]:
        with self._guides_lock:
            if self._guides is not None:
                self._guides.close()
        return super()._close_locked()

    def _open(self, request: EngineRequest) -> HFSeq:
        """Check and build a sequence; a structured output compiles here, on the caller's
        thread (bounded by the compiler's timeout) unless `ready_for` compiled it already, and
        replays any resumed tokens."""
        tok = self.tokenizer
        seq = open_seq(
            HFSeq,
            request,
            decode=tok.decode,
            eos_token_ids=tok.eos_token_ids,
            model_limits=self.limits(),
        )
        seq.priority = request.priority
        params = seq.params
        if params.features - _OUTSIDE_ROW_FEATURES:
            resumed = request.resume_token_ids
            matcher = None
            if params.guide is not None:
                matcher = self._guide_compiler().matcher(params.guide, resumed)
            seq.features = RowFeatures(
                params,
                prompt_ids=request.prompt_token_ids,
                output_ids=resumed,
                stop_ids=tok.eos_token_ids,
                matcher=matcher,
                bad_words=self._bad_words(params.bad_words),
            )
        return seq

    def _bad_words(self, words: Sequence[str]) -> list[tuple[int, ...]]:
        """Bad words as token sequences, as vLLM makes them; one the model cannot embed is
        the request's fault."""
        if not words:
            return []
        tok = self.tokenizer
        ids = bad_words_token_ids(words, lambda t: tok.encode(t, add_special_tokens=False))
        if any(t >= self.logits_vocab for seq in ids for t in seq):
            raise InvalidRequest(
                f"a bad word has tokens beyond the model's vocabulary ({self.logits_vocab})",
                param="bad_words",
            )
        return ids

    def _prepare_prompt_logprobs(self, seqs: Sequence[HFSeq | None]) -> None:
        """Compute the prompt logprobs of those sequences that asked and have none yet: one
        forward pass over each prompt (vLLM's cost too), on the thread that runs the model,
        outside the engine's lock."""
        for seq in seqs:
            if seq is None or seq.params.prompt_logprobs is None or seq.prompt_logprobs_sent:
                continue
            if seq.prompt_logprobs is None:
                prompt = seq.input_ids[: seq.prompt_tokens]
                assert self.model is not None
                model: torch.nn.Module = self.model  # type: ignore[assignment]
                with torch.inference_mode():
                    ids = torch.tensor([prompt], device=self.device)
                    if self._lora is not None:  # the prompt as its adapter reads it
                        self._lora.plan(
                            () if seq.adapter is None else ((seq.adapter, 0, len(prompt)),)
                        )
                    logits = model(ids).logits[0, :-1]
                seq.prompt_logprobs = prompt_logprobs(
                    logits, prompt[1:], seq.params.prompt_logprobs
                )

    @staticmethod
    def _with_prompt_logprobs(seq: HFSeq, output: StepOutput) -> StepOutput:
        """The sequence's first output carries its prompt logprobs."""
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            output.prompt_logprobs = seq.prompt_logprobs
            seq.prompt_logprobs_sent = True
        return output

    def _features_update(self, seq: HFSeq, new: list[int]) -> tuple[str | None, bool]:
        """Advance a sequence's features past its new tokens: (an error, whether its
        structured output is complete)."""
        f = seq.features
        if f is None:
            return None, False
        f.push(new)
        if f.matcher is None:
            return None, False
        for t in new:
            if not f.matcher.accept(t):
                # only when nothing was allowed (e.g. min_tokens holds back the one ending)
                return f"token {t} does not follow the structured output", False
        return None, f.matcher.terminated


# --------------------------------------------------------------------------------------------
# Continuous batching
# --------------------------------------------------------------------------------------------


class HFEngine(HFEngineBase):
    """transformers continuous batching: sequences join and leave the running batch every step.

    `max_seqs` / `max_tokens` (the token budget) default from the device: on CUDA from free
    memory after the weights (`kv_cache_memory_fraction` of it) and the model's KV bytes per
    token, on CPU 64 sequences each allowed the whole context, bounded by RAM. The paged cache
    is sized to hold the budget; capacity is final once `start()` returned.
    """

    name = "hf"
    features = frozenset(Feature)

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny",
        *,
        max_seqs: int | None = None,
        max_tokens: int | None = None,
        page_size: int | None = None,
        max_batch_tokens: int | None = None,
        kv_cache_memory_fraction: float | None = None,
        cuda_graphs: bool = True,
        warmup: bool = True,
        loras: Mapping[str, str] | None = None,
        max_loras: int = 4,
        **load: Unpack[HFLoadOptions],
    ) -> None:
        super().__init__(model, **load)
        cuda = self.device.type == "cuda"
        # LoRA adapters by name (`--lora NAME=PATH`; others load from a job's path), at most
        # `max_loras` resident (engines/lora.py)
        self.loras = dict(loras or {})
        self.max_loras = max_loras
        if self.loras and importlib.util.find_spec("peft") is None:
            # else the worker would start and fail each of the adapters' jobs instead
            raise FatalError(
                "--lora needs peft, which is not installed: pip install 'tokenyard[hf]'"
            )
        if self.loras and cuda_graphs and cuda:
            # a replayed graph runs no Python hook: the adapters' spans change every pass
            log.info("CUDA graphs off: LoRA adapters are configured")
            cuda_graphs = False
        config = self.config
        self.page_size = page_size or (256 if cuda else 64)
        default_fraction = CUDA_KV_FRACTION if cuda else CPU_KV_FRACTION
        self.kv_fraction = kv_cache_memory_fraction or default_fraction
        self._kv_bytes = kv_bytes_per_token(config, self.dtype)
        self._wanted = (max_seqs, max_tokens)
        self._default_seqs = CUDA_MAX_SEQS if cuda else CPU_MAX_SEQS
        if cuda:
            # CUDA is not touched before start() (a process engine's parent must not hold a
            # context): until the cache is measured, the estimate is bounded by the context only.
            kv_tokens = (self._default_seqs if max_seqs is None else max_seqs) * (
                self.tokenizer.max_model_len + 2 * self.page_size
            )
        else:
            kv_tokens = int(available_ram() * self.kv_fraction) // self._kv_bytes
        self.capacity = self._plan(kv_tokens)
        self.max_batch_tokens = max_batch_tokens
        self.cuda_graphs = cuda_graphs
        self.warmup = warmup
        self._manager: ContinuousBatchingManager | None = None
        self._by_internal: dict[str, HFSeq] = {}
        self._backlog: list[HFSeq] = []  # added before start()
        # Cancelled in the manager but maybe not gone yet (a cancel can overtake its request in
        # the manager's queues); bounded, since the manager never confirms a cancellation.
        self._zombies: OrderedDict[str, None] = OrderedDict()
        # requests run with an adapter, whose KV blocks are never shared: remembered past
        # their end (the cache may mark a finished request's blocks), bounded
        self._apart: OrderedDict[str, None] = OrderedDict()
        self._ids = itertools.count()
        # prompt tokens transformers' prefix sharing matched, by request id, written on the
        # manager's thread as it schedules a request and read with that request's outputs;
        # None: prefix sharing is off (the model's layers cannot share blocks)
        self._prefix_matches: dict[str, int] | None = None
        self._warm = threading.Event()
        self._processor: _SamplingProcessors | None = None

    @property
    def runs_adapters(self) -> bool:  # type: ignore[override]
        # CUDA graphs replay no hook: adapters need them off (they are, given --lora)
        return not self._graphs_on()

    def _graphs_on(self) -> bool:
        return self.cuda_graphs and self.device.type == "cuda"

    def _plan_adapters(self, requests: list[FutureRequestState]) -> None:
        """The next pass's adapter spans over its packed tokens (on the manager thread)."""
        lora = self._lora
        if lora is None or not lora.stacked:
            return  # no adapter loaded: nothing to plan, every pass is the base's
        spans: list[tuple[str, int, int]] = []
        start = base = 0
        for request in requests:
            end = start + int(request.query_length)
            seq = self._by_internal.get(request.state.request_id)
            if seq is not None and seq.adapter is not None:
                spans.append((seq.adapter, start, end))
            else:
                base += end - start
            start = end
        lora.plan(spans, base)

    def _row_features(self, internal_id: str) -> RowFeatures | None:
        """A running sequence's features (on the manager thread; a dict read needs no lock)."""
        seq = self._by_internal.get(internal_id)
        return None if seq is None else seq.features

    def _plan(self, kv_tokens: int) -> EngineCapacity:
        max_seqs, max_tokens = self._wanted
        return plan_capacity(
            kv_tokens=kv_tokens,
            page_size=self.page_size,
            max_model_len=self.tokenizer.max_model_len,
            max_seqs=max_seqs,
            max_tokens=max_tokens,
            default_seqs=self._default_seqs,
        )

    async def start(self) -> None:
        if self._started:
            return
        self._channel.bind(asyncio.get_running_loop())
        await asyncio.to_thread(self._start_sync)

    def _cb_config(self) -> ContinuousBatchingConfig:
        cuda = self.device.type == "cuda"
        total = 0
        share = 0  # CUDA: the bytes the KV cache may take
        if cuda:
            free, total = torch.cuda.mem_get_info(self.device)
            share = int(free * self.kv_fraction)
            self.capacity = self._plan(share // self._kv_bytes)
        cap = self.capacity
        batch_tokens = self.max_batch_tokens
        if batch_tokens is None:
            # CPU: a modest prefill chunk; every running sequence decodes in one pass.
            cpu_tokens = max(512, cap.max_seqs)
            batch_tokens = cuda_batch_tokens(total, cap.max_seqs) if cuda else cpu_tokens
        # The budget, plus a page per sequence: each may leave its last page partly empty.
        blocks: int | None = math.ceil(cap.max_tokens / self.page_size) + cap.max_seqs
        if cuda and blocks is not None and blocks * self.page_size * self._kv_bytes > share // 2:
            # Memory, not the context, bounds the cache: transformers fills the share itself,
            # paying first for its activations and attention masks (measured after warmup()).
            blocks = None
        return ContinuousBatchingConfig(
            page_size=self.page_size,
            num_blocks=blocks,
            max_batch_tokens=batch_tokens,
            max_memory_percent=self.kv_fraction if cuda else 0.9,
            max_requests_per_batch=cap.max_seqs,
            use_cuda_graph=self.cuda_graphs and cuda,
            seed=self.seed,
            # Asynchronous batching prepares step N+1 before step N's token is known: the
            # penalties and a structured output's mask need that token first.
            use_async_batching=False,
        )

    def _start_sync(self) -> None:
        model = self._load_model()
        eos = sorted(self.tokenizer.eos_token_ids)
        generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,  # tokenyard's processors pick the token; the manager takes argmax
            max_new_tokens=self.tokenizer.max_model_len,
            eos_token_id=eos or -1,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        cb_config = self._cb_config()
        manager = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        # Both must be replaced before the batch processor exists: it picks them up when created.
        # They are manager internals (checked against transformers 5.23), so fail loudly.
        if not (
            hasattr(manager, "logit_processor")
            and hasattr(manager, "output_router")
            and hasattr(manager, "_create_batch_processor")
        ):
            raise RuntimeError("unsupported transformers continuous-batching internals")
        create = manager._create_batch_processor

        def create_isolating() -> Any:
            # the generation loop makes its own processor (and paged cache): each is patched
            processor = create()
            self._isolate_salted(processor.cache)
            self._prefill_by_priority(processor.scheduler)
            self._alone_first(processor.scheduler)
            if capture_buckets:
                # on the generation thread, before its first step: the shapes a served batch
                # meets are captured now, not one stalled step at a time (engines/hf_graphs.py)
                capture_query_buckets(processor, model)
            return processor

        capture_buckets = False  # not into the processor `warmup()` sizes the cache with
        manager._create_batch_processor = create_isolating  # type: ignore[method-assign]
        self._processor = _SamplingProcessors(
            self._row_features,
            rows=cb_config.max_requests_per_batch or self.capacity.max_seqs,
            vocab=self.logits_vocab,
            device=self.device,
            eager_buffers=self._graphs_on(),
            on_batch=self._plan_adapters,
        )
        manager.logit_processor = self._processor
        if not self._graphs_on():
            lora = LoraSet(cast(torch.nn.Module, model), self.loras, self.max_loras, self.dtype)
            lora.attach()
            self._lora = lora
        manager.output_router = _StepRouter(self._on_outputs)
        # Creates the paged cache now, so its real size is known, and with CUDA graphs captures
        # them at the largest batch; `warmup` adds one real request for the smallest shapes.
        manager.warmup()
        # the loop's own processor, made when it starts, is the one that steps: capture there
        capture_buckets = self.warmup and self._graphs_on()
        cache = manager.batch_processor.cache if manager.batch_processor is not None else None
        if cache is not None:
            measured = self._plan(int(cache.num_blocks) * self.page_size)
            if measured != self.capacity:
                log.info("engine capacity from the KV cache: %s", measured)
            self.capacity = measured
        manager.start()
        if self.warmup:
            self._warm_up(manager)
        if cache is not None and cache.use_prefix_sharing:
            self._count_prefix_matches(cache)  # after the warm-up: its lookup counts nothing
        with self._lock:
            self._manager = manager
            self._started = True
            backlog, self._backlog = self._backlog, []
            for seq in backlog:
                if self._seqs.get(seq.seq_id) is seq:
                    self._submit_locked(seq)

    def _count_prefix_matches(self, cache: Any) -> None:
        """Wrap the cache's prefix lookup (a transformers internal, as `kv_in_use` reads) to
        learn what each request reused: its `cached_tokens` and the prefix-cache counters."""
        search = cache.search_prefix_match
        matches: dict[str, int] = {}

        def counted(request_id: str, prompt_ids: list[int]) -> int:
            found = int(search(request_id, prompt_ids))
            matches[request_id] = found
            with self._lock:
                self._stats.prefix_cache_queries += len(prompt_ids)
                self._stats.prefix_cache_hits += found
            return found

        cache.search_prefix_match = counted
        self._prefix_matches = matches

    def _salted(self, internal_id: str) -> bool:
        # an adapter's KV is not the base's (nor another adapter's): kept apart as a salt is
        seq = self._by_internal.get(internal_id)
        if internal_id in self._apart:
            return True
        return seq is not None and seq.params.cache_salt is not None

    def _isolate_salted(self, cache: Any) -> None:
        """Keep a salted sequence out of the paged cache's prefix sharing: it reuses no cached
        block and offers none of its own. transformers keys blocks by their tokens alone, so a
        salt cannot pick a cache of its own: no sharing at all is what keeps salts apart
        (stricter than vLLM, where sequences of one salt share)."""
        search, mark = cache.search_prefix_match, cache.mark_complete_blocks

        def search_prefix_match(request_id: str, prompt_ids: list[int]) -> int:
            return 0 if self._salted(request_id) else int(search(request_id, prompt_ids))

        def mark_complete_blocks(state: Any, complete_blocks: dict[str, int]) -> None:
            if not self._salted(state.request_id):
                mark(state, complete_blocks)

        cache.search_prefix_match = search_prefix_match
        cache.mark_complete_blocks = mark_complete_blocks

    def _rank(self, internal_id: str) -> int:
        seq = self._by_internal.get(internal_id)  # a dict read on the manager thread
        return Priority.NORMAL if seq is None else seq.priority

    def _prefill_by_priority(self, scheduler: Any) -> None:
        """Keep the manager's waiting requests (prefill not begun) in lane order, arrival
        order within a lane. transformers' FIFO scheduler prefills them in arrival order, a
        few hundred prompt tokens a step: a high-priority job (one a preemption just made room
        for) added behind a wave of fresh prompts would wait out their prefills, steps after
        its slot was free. (A transformers internal, as `_isolate_salted` patches.)"""
        if getattr(scheduler, "_tokenyard_by_priority", False):
            return  # the manager hands its warm-up's processor to the generation loop
        add = scheduler.add_waiting_request

        def add_waiting_request(state: Any) -> None:
            add(state)
            order = scheduler.waiting_requests_order
            rank = self._rank(state.request_id)
            # the queue is kept in order, so one look at its neighbour settles the usual case
            if len(order) < 2 or order[-1] != state.request_id or self._rank(order[-2]) <= rank:
                return
            order.pop()
            at = next(i for i, rid in enumerate(order) if self._rank(rid) > rank)
            order.insert(at, state.request_id)

        scheduler.add_waiting_request = add_waiting_request
        scheduler._tokenyard_by_priority = True

    def _alone_first(self, scheduler: Any) -> None:
        """A pass that starts an `alone` sequence (`EngineRequest.alone`) holds only those:
        transformers' schedulers put every decoding request in each pass before any prefill, so
        while an alone request waits its pass is scheduled with the running requests hidden
        (they wait that one pass out, as tokenyard's scheduler asked), then they come back.
        On the manager's thread, which alone reads these lists. (A transformers internal, as
        `_prefill_by_priority` patches.)"""
        if getattr(scheduler, "_tokenyard_alone", False):
            return
        schedule = scheduler.schedule_batch

        def waiting_alone(request_id: str) -> bool:
            seq = self._by_internal.get(request_id)  # a dict read, as `_rank`
            return seq is not None and seq.alone

        def schedule_batch(token_budget: int, cache_budget: int) -> Any:
            order = scheduler.waiting_requests_order
            alone = [rid for rid in order if waiting_alone(rid)]
            if not alone or scheduler.block_new_requests:
                return schedule(token_budget, cache_budget)
            active = scheduler.active_requests
            scheduler.active_requests = {}
            scheduler.waiting_requests_order = type(order)(alone)
            try:
                return schedule(token_budget, cache_budget)
            finally:
                # what began its prefill joined the new dict: back into the running set
                active.update(scheduler.active_requests)
                scheduler.active_requests = active
                still = set(scheduler.waiting_requests_order)  # alone ones that did not fit
                asked = set(alone)
                scheduler.waiting_requests_order = type(order)(
                    rid for rid in order if rid in still or rid not in asked
                )
                for rid in alone:
                    seq = self._by_internal.get(rid)
                    if seq is not None and rid not in still:
                        seq.alone = False  # its first pass is scheduled: it runs as any other

        scheduler.schedule_batch = schedule_batch
        scheduler._tokenyard_alone = True

    def _warm_up(self, manager: ContinuousBatchingManager) -> None:
        """One short request through the whole path: first-step allocations and the smallest
        graphs are paid for here."""
        prompt = [self.tokenizer.pad_token_id] * 8
        manager.add_request(
            prompt, request_id=_WARMUP_ID, max_new_tokens=2, streaming=False, eos_token_id=-1
        )
        if not self._warm.wait(timeout=600):
            log.warning("engine warm-up did not finish in 600 s")

    async def stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            manager = self._manager
            # Detach every sequence first: the manager's own failure outputs for them (from the
            # hard stop) then arrive as strays, and each gets one "engine stopped" instead.
            left = self._close_locked()
            self._by_internal.clear()
            self._backlog.clear()
        self._deliver(left)
        if manager is not None:
            await asyncio.to_thread(manager.stop, block=True, timeout=60, hard_stop=True)
            await asyncio.to_thread(manager.destroy)
        self._channel.close()

    def add(self, request: EngineRequest) -> None:
        seq = self._open(request)
        if request.adapter is not None:
            if self._lora is None:
                raise InvalidRequest(
                    f"The model '{request.adapter}' is a LoRA adapter: this engine runs none "
                    "until started, and none with CUDA graphs on",
                    param="model",
                )
            # loaded (from disk, the first time) on the caller's thread, between passes
            self._lora.ensure(request.adapter, request.adapter_path)
            seq.adapter = request.adapter
        with self._lock:
            try:
                held = self._hold_locked(seq)
            except BaseException:  # full, or stopped: the adapter is not kept for it
                self._drop_adapter(seq)
                raise
            if not held:
                self._drop_adapter(seq)
                return
            if self._started:
                self._submit_locked(seq)
            else:
                self._backlog.append(seq)

    def _abort_locked(self, seq: HFSeq) -> None:
        seq.aborted = True
        self._finish_locked(seq, engine_done=False)

    def stats(self) -> EngineStats:
        stats = super().stats()
        manager = self._manager
        processor = manager.batch_processor if manager is not None else None
        if processor is not None:
            # Plain reads of the manager's lists: a moment's snapshot is all a gauge needs.
            stats.kv_cache_usage = round(kv_in_use(processor.cache), 4)
            stats.waiting = len(processor.scheduler.waiting_requests)  # prefill not yet begun
        return stats

    def _submit_locked(self, seq: HFSeq) -> None:
        assert self._manager is not None
        seq.internal_id = f"{seq.seq_id}#{next(self._ids)}"
        self._by_internal[seq.internal_id] = seq
        if seq.adapter is not None:
            self._apart[seq.internal_id] = None
            while len(self._apart) > _MAX_ZOMBIES:
                self._apart.popitem(last=False)
        if self._prefix_matches is not None:
            seq.cached_tokens = 0  # known: a match found when it is scheduled says more
        p = seq.params
        accepted = self._manager.add_request(
            seq.input_ids,
            request_id=seq.internal_id,
            max_new_tokens=seq.decoder.remaining,
            streaming=True,
            eos_token_id=-1 if p.ignore_eos else sorted(self.tokenizer.eos_token_ids) or -1,
            temperature=float(p.temperature),
            top_k=int(p.top_k),
            top_p=float(p.top_p),
            min_p=float(p.min_p),
            noise_seed=-1 if seq.noise_seed is None else int(seq.noise_seed),
        )
        if accepted is None:
            self._finish_locked(seq, engine_done=True)
            refused = seq.finish(FinishReason.ERROR, "engine is not accepting requests")
            self._deliver([refused])

    def _drop_adapter(self, seq: HFSeq) -> None:
        if seq.adapter is not None and self._lora is not None:
            self._lora.release(seq.adapter)
            seq.adapter = None  # once, however many paths end it

    def _finish_locked(self, seq: HFSeq, *, engine_done: bool) -> None:
        """Forget a sequence; unless the manager finished it itself, cancel it there."""
        self._drop_adapter(seq)
        self._release_locked(seq)
        if not seq.internal_id:
            return  # still in the backlog: the manager never saw it
        self._by_internal.pop(seq.internal_id, None)
        if self._prefix_matches is not None:
            self._prefix_matches.pop(seq.internal_id, None)
        if not engine_done and self._manager is not None:
            self._manager.cancel_request(seq.internal_id)
            self._zombies[seq.internal_id] = None
            while len(self._zombies) > _MAX_ZOMBIES:
                self._zombies.popitem(last=False)

    def _on_outputs(self, outputs: list[GenerationOutput]) -> None:
        """Runs on the manager's thread after every forward pass."""
        step = []
        stepped = 0
        logprobs = self._processor.step_logprobs() if self._processor is not None else {}
        self._prepare_prompt_logprobs([self._by_internal.get(o.request_id) for o in outputs])
        with self._lock:
            for out in outputs:
                seq = self._by_internal.get(out.request_id)
                if seq is None:
                    self._handle_stray_locked(out)
                    continue
                if out.error is not None:
                    step.append(seq.finish(FinishReason.ERROR, error=str(out.error)))
                    self._finish_locked(seq, engine_done=True)
                    continue
                if self._prefix_matches is not None:
                    found = self._prefix_matches.pop(out.request_id, None)
                    if found is not None:
                        seq.cached_tokens = min(found, seq.prompt_tokens)
                new = out.generated_tokens[seq.seen :]
                seq.seen = len(out.generated_tokens)
                if new:
                    stepped += 1
                error, complete = self._features_update(seq, new)
                if error is not None:
                    step.append(seq.finish(FinishReason.ERROR, error=error))
                    self._finish_locked(seq, engine_done=out.is_finished())
                    continue
                delta = seq.decoder.feed(new)
                if delta.finish_reason is None and (complete or out.is_finished()):
                    # The grammar is complete, or the manager stopped first (its own length or
                    # EOS check): agree with it.
                    last_eos = bool(new) and new[-1] in self.tokenizer.eos_token_ids
                    stop = complete or last_eos
                    tail = seq.decoder.close(FinishReason.STOP if stop else FinishReason.LENGTH)
                    delta = Delta(delta.token_ids, delta.text + tail.text, tail.finish_reason)
                self._stats.tokens_generated += len(delta.token_ids)
                if delta.token_ids or delta.text or delta.finish_reason is not None:
                    output = self._with_prompt_logprobs(seq, seq.output(delta))
                    if seq.params.logprobs is not None and delta.token_ids:
                        output.logprobs = _token_logprobs(
                            delta.token_ids, logprobs.get(out.request_id), seq.params.logprobs
                        )
                    step.append(output)
                if delta.finish_reason is not None:
                    self._finish_locked(seq, engine_done=out.is_finished())
            if stepped:
                self._stats.steps += 1
                self._stats.sequences_stepped += stepped
            self._deliver(step)

    def _handle_stray_locked(self, out: GenerationOutput) -> None:
        if self._prefix_matches is not None:
            self._prefix_matches.pop(out.request_id, None)
        if out.request_id == _WARMUP_ID:
            if out.is_finished():
                self._warm.set()
            return
        # Output for a sequence we already finished (abort, stop string): make sure the manager
        # really drops it, since a cancel can race with the request being queued.
        if out.request_id not in self._zombies:
            return
        if out.is_finished():
            self._zombies.pop(out.request_id, None)
        elif self._manager is not None:
            self._manager.cancel_request(out.request_id)


def _token_logprobs(token_ids: list[int], entry: _StepLogprob | None, k: int) -> list[TokenLogprob]:
    """The logprobs of one step's tokens: the step's entry for its (one) sampled token.

    A sequence gains one token per step, so `token_ids` has one; the entry's own token is the
    one the manager chose (the same argmax), kept as a check. Without an entry (never expected)
    the value is NaN rather than a misaligned list.
    """
    result = []
    for i, tok in enumerate(token_ids):
        if entry is not None and i == len(token_ids) - 1 and entry[0] == tok:
            result.append(TokenLogprob(tok, entry[1], tuple(entry[2][:k])))
        else:
            result.append(TokenLogprob(tok, math.nan))
    return result
