"""transformers engines: continuous batching (the CB manager) and a static micro-batch baseline.

Sampling is done by tokenyard, not by transformers' sampler, in both modes: logits are
temperature-scaled and top-k/top-p filtered per row, then Gumbel noise keyed by
(seed, absolute position) is added and the argmax is taken. That gives exact greedy
decoding (temperature 0 is a plain argmax), honours per-request seeds, and makes seeded
sampling independent of batch composition, so a resumed sequence continues exactly.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessor,
    ContinuousBatchingLogitsProcessorList,
)
from transformers.generation.continuous_batching.continuous_api import OutputRouter
from transformers.generation.continuous_batching.requests import (
    FutureRequestState,
    GenerationOutput,
)
from transformers.utils import logging as hf_logging

from tokenyard.engines.base import (
    Engine,
    EngineCapacity,
    EngineStats,
    OutputChannel,
    StepOutput,
    default_seed,
    size_request,
)
from tokenyard.engines.detok import Delta, SequenceDecoder
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path
from tokenyard.messages import FinishReason, SamplingParams

if TYPE_CHECKING:
    from transformers import ContinuousBatchingManager


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
_MASK32 = 0xFFFFFFFF
_MAX_ZOMBIES = 4096
_MASK64 = (1 << 64) - 1

# --------------------------------------------------------------------------------------------
# Sampling: tensor ops only, so they are safe inside CUDA graphs; shortcuts that need a host
# sync are skipped while a graph is being captured.
# --------------------------------------------------------------------------------------------


def noise_key(seed: int, position: int) -> int:
    """31-bit key for the noise of one (seed, absolute position); splitmix64 finaliser."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0x7FFFFFFF


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def apply_temperature(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Scale rows by 1/T; rows with T <= 0 (greedy) become one-hot on their argmax."""
    greedy = (temperature <= 0).unsqueeze(-1)
    onehot = torch.full_like(scores, float("-inf"))
    onehot.scatter_(-1, scores.argmax(dim=-1, keepdim=True), 0.0)
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return torch.where(greedy, onehot, scores / safe_t.unsqueeze(-1))


def apply_top_k(scores: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k best logits; k <= 0 keeps all."""
    vocab = scores.size(-1)
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    if not _capturing(scores) and bool((k >= vocab).all()):
        return scores
    kth = torch.sort(scores, dim=-1, descending=True)[0].gather(-1, (k - 1).long().unsqueeze(-1))
    return scores.masked_fill(scores < kth, float("-inf"))


def apply_top_p(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Nucleus filter per row; p >= 1 keeps all (same rule as transformers' TopPLogitsWarper)."""
    if not _capturing(scores) and bool((top_p >= 1).all()):
        return scores
    sorted_logits, sorted_idx = torch.sort(scores, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p).unsqueeze(-1)
    remove[..., -1:] = False
    return scores.masked_fill(remove.scatter(-1, sorted_idx, remove), float("-inf"))


def add_gumbel_noise(scores: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Add Gumbel(0, 1) noise derived from (key, vocab index); rows with key < 0 are left as is.

    argmax(logits + Gumbel) is an exact sample from softmax(logits), and the noise is a pure
    function of the key, so the same (seed, position) always draws the same token.
    """
    if not _capturing(scores) and bool((keys < 0).all()):
        return scores
    keys64 = keys.long().clamp_min(0).unsqueeze(-1)
    idx = torch.arange(scores.size(-1), device=scores.device, dtype=torch.int64).unsqueeze(0)
    # lowbias32 hash in int64 arithmetic; products wrap, and only the low 32 bits are kept.
    x = (keys64 * 0x9E3779B1 + idx * 0x85EBCA6B + 0x27D4EB2F) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    x = x ^ (x >> 16)
    # 23 random bits keep u strictly inside (0, 1) in float32, so both logs stay finite.
    u = ((x >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    gumbel = -torch.log(-torch.log(u))
    return torch.where((keys >= 0).unsqueeze(-1), scores + gumbel.to(scores.dtype), scores)


def sample_keys(seeds: Sequence[int | None], positions: Sequence[int]) -> list[int]:
    """Noise keys per row; None marks a greedy row."""
    return [-1 if s is None else noise_key(s, p) for s, p in zip(seeds, positions, strict=True)]


# --------------------------------------------------------------------------------------------
# Per-request sampling inside the CB manager. Each processor receives one int32 per row; the
# manager fills them from each request's logit_processor_kwargs.
# --------------------------------------------------------------------------------------------


def _float_arg(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).view(torch.int32)


def _fill_float(int32_tensor: torch.Tensor, value: float) -> None:
    int32_tensor.copy_(torch.full_like(int32_tensor, value, dtype=torch.float32).view(torch.int32))


def _kwarg(request: FutureRequestState, name: str, default: float) -> Any:
    return request.state.logit_processor_kwargs.get(name, default)


class _CBTemperature(ContinuousBatchingLogitsProcessor):
    supported_kwargs = {"temperature": float}
    ignored_kwargs = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        _fill_float(int32_tensor, 1.0)

    def prepare_tensor_args(
        self, requests_with_new_token: list[FutureRequestState]
    ) -> torch.Tensor:
        return _float_arg([_kwarg(r, "temperature", 1.0) for r in requests_with_new_token])

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return apply_temperature(scores, tensor_arg[: scores.size(0)].view(torch.float32))


class _CBTopK(ContinuousBatchingLogitsProcessor):
    supported_kwargs = {"top_k": int}
    ignored_kwargs = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(
        self, requests_with_new_token: list[FutureRequestState]
    ) -> torch.Tensor:
        values = [_kwarg(r, "top_k", 0) for r in requests_with_new_token]
        return torch.tensor(values, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return apply_top_k(scores, tensor_arg[: scores.size(0)])


class _CBTopP(ContinuousBatchingLogitsProcessor):
    supported_kwargs = {"top_p": float}
    ignored_kwargs = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        _fill_float(int32_tensor, 1.0)

    def prepare_tensor_args(
        self, requests_with_new_token: list[FutureRequestState]
    ) -> torch.Tensor:
        return _float_arg([_kwarg(r, "top_p", 1.0) for r in requests_with_new_token])

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return apply_top_p(scores, tensor_arg[: scores.size(0)].view(torch.float32))


class _CBNoise(ContinuousBatchingLogitsProcessor):
    supported_kwargs = {"noise_seed": int}
    ignored_kwargs = ()

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(-1)

    def prepare_tensor_args(
        self, requests_with_new_token: list[FutureRequestState]
    ) -> torch.Tensor:
        seeds: list[int | None] = []
        positions: list[int] = []
        for r in requests_with_new_token:
            seed = r.state.logit_processor_kwargs.get("noise_seed", -1)
            seeds.append(None if seed < 0 else seed)
            # position_offset already counts this step's query tokens: it is the absolute index of
            # the token being sampled, which is the same with or without a resume.
            positions.append(r.state.position_offset)
        return torch.tensor(sample_keys(seeds, positions), dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        return add_gumbel_noise(scores, tensor_arg[: scores.size(0)])


def _cb_processors() -> ContinuousBatchingLogitsProcessorList:
    processors = [_CBTemperature(), _CBTopK(), _CBTopP(), _CBNoise()]
    plist = ContinuousBatchingLogitsProcessorList(LogitsProcessorList(processors))
    # The list only counts tensors for processors it converted itself; ours need one each.
    plist.tensors_required = len(processors)
    return plist


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
# Shared engine plumbing
# --------------------------------------------------------------------------------------------


@dataclass
class _Seq:
    seq_id: str
    prompt_tokens: int
    input_ids: list[int]  # prompt + resumed tokens
    params: SamplingParams
    decoder: SequenceDecoder
    reserved: int
    noise_seed: int | None  # None: greedy
    internal_id: str = ""
    seen: int = 0  # tokens of the CB output already consumed
    aborted: bool = False

    def output(self, delta: Delta, error: str | None = None) -> StepOutput:
        return StepOutput(
            seq_id=self.seq_id,
            token_ids=delta.token_ids,
            text=delta.text,
            finish_reason=delta.finish_reason,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.decoder.completion_tokens,
            error=error,
        )

    def finish(self, reason: FinishReason, error: str | None = None) -> StepOutput:
        return self.output(Delta([], "", reason), error)


class _HFEngineBase(Engine):
    """Model/tokenizer loading, sequence bookkeeping and output delivery shared by both modes."""

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        device: str,
        dtype: str,
        max_seqs: int,
        max_tokens: int,
        attn_implementation: str,
        seed: int,
        threads: int | None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        self.model_path = resolve_model_path(model)
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.attn_implementation = attn_implementation
        self.seed = seed
        self.threads = threads
        self.capacity = EngineCapacity(max_seqs=max_seqs, max_tokens=max_tokens)
        self.tokenizer: HFTokenizer = load_hf_tokenizer(self.model_path)
        self.model: CausalLM | None = None
        self._lock = threading.RLock()
        self._channel = OutputChannel()
        self._stats = EngineStats()
        self._seqs: dict[str, _Seq] = {}
        self._pending: deque[_Seq] = deque()
        self._started = False
        self._closed = False

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

    def _make_seq(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Sequence[int],
    ) -> _Seq:
        tok = self.tokenizer
        limit, reserved = size_request(
            seq_id, prompt_token_ids, params, tok.max_model_len, self.capacity.max_tokens
        )
        decoder = SequenceDecoder(
            tok.decode,
            params,
            prompt_ids=prompt_token_ids,
            eos_token_ids=tok.eos_token_ids,
            resume_ids=resume_token_ids,
            limit=limit,
        )
        noise_seed = None
        if not params.greedy:
            noise_seed = params.seed if params.seed is not None else default_seed(seq_id)
        return _Seq(
            seq_id=seq_id,
            prompt_tokens=len(prompt_token_ids),
            input_ids=[*prompt_token_ids, *resume_token_ids],
            params=params,
            decoder=decoder,
            reserved=reserved,
            noise_seed=noise_seed,
        )

    def _enqueue(self, seq: _Seq) -> bool:
        """Register a new sequence; False when its resumed tokens already finished it."""
        with self._lock:
            if self._closed:
                raise RuntimeError("engine is stopped")
            if seq.seq_id in self._seqs:
                raise ValueError(f"sequence {seq.seq_id!r} is already in the engine")
            if seq.decoder.finish_reason is not None:
                self._channel.publish([seq.finish(seq.decoder.finish_reason)])
                return False
            self._seqs[seq.seq_id] = seq
            self._pending.append(seq)
            return True

    async def outputs(self) -> list[StepOutput]:
        return await self._channel.get()

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            return EngineStats(s.steps, s.sequences_stepped, s.tokens_generated, s.running)


# --------------------------------------------------------------------------------------------
# Continuous batching
# --------------------------------------------------------------------------------------------


class HFEngine(_HFEngineBase):
    """transformers continuous batching: sequences join and leave the running batch every step.

    Admission is bounded by `max_seqs` and a token budget (prompt + max new tokens reserved
    per sequence); the paged KV cache is sized to that budget.
    """

    name = "hf"

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny",
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_seqs: int = 32,
        max_tokens: int = 32768,
        page_size: int = 64,
        max_batch_tokens: int = 512,
        attn_implementation: str = "sdpa",
        seed: int = 0,
        threads: int | None = None,
    ) -> None:
        super().__init__(
            model,
            device=device,
            dtype=dtype,
            max_seqs=max_seqs,
            max_tokens=max_tokens,
            attn_implementation=attn_implementation,
            seed=seed,
            threads=threads,
        )
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self._manager: ContinuousBatchingManager | None = None
        self._by_internal: dict[str, _Seq] = {}
        # Cancelled in the manager but maybe not gone yet (a cancel can overtake its request in
        # the manager's queues); bounded, since the manager never confirms a cancellation.
        self._zombies: OrderedDict[str, None] = OrderedDict()
        self._reserved = 0
        self._ids = itertools.count()

    async def start(self) -> None:
        if self._started:
            return
        self._channel.bind(asyncio.get_running_loop())
        await asyncio.to_thread(self._start_sync)

    def _start_sync(self) -> None:
        model = self._load_model()
        eos = sorted(self.tokenizer.eos_token_ids)
        generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,  # tokenyard's processors pick the token; the manager takes argmax
            max_new_tokens=self.capacity.max_tokens,
            eos_token_id=eos or -1,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        # Every sequence may waste up to one partially filled page.
        num_blocks = -(-self.capacity.max_tokens // self.page_size) + self.capacity.max_seqs
        cb_config = ContinuousBatchingConfig(
            page_size=self.page_size,
            num_blocks=num_blocks,
            max_batch_tokens=self.max_batch_tokens,
            max_requests_per_batch=self.capacity.max_seqs,
            seed=self.seed,
        )
        manager = model.init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_config
        )
        # Both must be replaced before start(): the batch processor picks them up when created.
        # They are manager internals (checked against transformers 5.23), so fail loudly.
        if not (hasattr(manager, "logit_processor") and hasattr(manager, "output_router")):
            raise RuntimeError("unsupported transformers continuous-batching internals")
        manager.logit_processor = _cb_processors()
        manager.output_router = _StepRouter(self._on_outputs)
        manager.start()
        with self._lock:
            self._manager = manager
            self._started = True
            self._admit_locked()

    async def stop(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            manager = self._manager
            # Detach every sequence first: the manager's own failure outputs for them (from the
            # hard stop) then arrive as strays, and each gets one "engine stopped" instead.
            left = list(self._seqs.values())
            self._seqs.clear()
            self._pending.clear()
            self._by_internal.clear()
            self._reserved = 0
            self._stats.running = 0
        self._channel.publish([s.finish(FinishReason.ERROR, "engine stopped") for s in left])
        if manager is not None:
            await asyncio.to_thread(manager.stop, block=True, timeout=60, hard_stop=True)
            await asyncio.to_thread(manager.destroy)
        self._channel.close()

    def add(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        seq = self._make_seq(seq_id, prompt_token_ids, params, resume_token_ids)
        with self._lock:
            if self._enqueue(seq) and self._started:
                self._admit_locked()

    def abort(self, seq_id: str) -> None:
        with self._lock:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                return
            seq.aborted = True
            if seq.internal_id:
                self._retire_locked(seq, cancel=True)
            else:
                self._pending.remove(seq)
            self._channel.publish([seq.finish(FinishReason.CANCELLED)])
            if self._started:
                self._admit_locked()

    def _admit_locked(self) -> None:
        manager = self._manager
        while manager is not None and self._pending:
            head = self._pending[0]
            if len(self._by_internal) >= self.capacity.max_seqs:
                break
            if self._reserved + head.reserved > self.capacity.max_tokens:
                break  # strict FIFO: a long sequence is not overtaken forever by short ones
            self._pending.popleft()
            head.internal_id = f"{head.seq_id}#{next(self._ids)}"
            self._by_internal[head.internal_id] = head
            self._reserved += head.reserved
            p = head.params
            accepted = manager.add_request(
                head.input_ids,
                request_id=head.internal_id,
                max_new_tokens=head.decoder.remaining,
                streaming=True,
                eos_token_id=-1 if p.ignore_eos else sorted(self.tokenizer.eos_token_ids) or -1,
                temperature=float(p.temperature),
                top_k=int(p.top_k),
                top_p=float(p.top_p),
                noise_seed=-1 if head.noise_seed is None else int(head.noise_seed),
            )
            if accepted is None:
                self._seqs.pop(head.seq_id, None)
                self._retire_locked(head, cancel=False)
                msg = "engine is not accepting requests"
                self._channel.publish([head.finish(FinishReason.ERROR, msg)])
        self._stats.running = len(self._by_internal)

    def _retire_locked(self, seq: _Seq, *, cancel: bool) -> None:
        if self._by_internal.pop(seq.internal_id, None) is not None:
            self._reserved -= seq.reserved
        if cancel and self._manager is not None:
            self._manager.cancel_request(seq.internal_id)
            self._zombies[seq.internal_id] = None
            while len(self._zombies) > _MAX_ZOMBIES:
                self._zombies.popitem(last=False)
        self._stats.running = len(self._by_internal)

    def _on_outputs(self, outputs: list[GenerationOutput]) -> None:
        """Runs on the manager's thread after every forward pass."""
        step: list[StepOutput] = []
        stepped = 0
        with self._lock:
            for out in outputs:
                seq = self._by_internal.get(out.request_id)
                if seq is None:
                    self._handle_stray_locked(out)
                    continue
                if out.error is not None:
                    delta = Delta([], "", FinishReason.ERROR)
                    step.append(seq.output(delta, error=str(out.error)))
                    self._finish_locked(seq, engine_done=True)
                    continue
                new = out.generated_tokens[seq.seen :]
                seq.seen = len(out.generated_tokens)
                if new:
                    stepped += 1
                delta = seq.decoder.feed(new)
                if delta.finish_reason is None and out.is_finished():
                    # The manager stopped first (its own length or EOS check): agree with it.
                    last_eos = bool(new) and new[-1] in self.tokenizer.eos_token_ids
                    tail = seq.decoder.close(FinishReason.STOP if last_eos else FinishReason.LENGTH)
                    delta = Delta(delta.token_ids, delta.text + tail.text, tail.finish_reason)
                self._stats.tokens_generated += len(delta.token_ids)
                if delta.token_ids or delta.text or delta.finish_reason is not None:
                    step.append(seq.output(delta))
                if delta.finish_reason is not None:
                    self._finish_locked(seq, engine_done=out.is_finished())
            if stepped:
                self._stats.steps += 1
                self._stats.sequences_stepped += stepped
            self._channel.publish(step)
            if step and self._started and not self._closed:
                self._admit_locked()

    def _handle_stray_locked(self, out: GenerationOutput) -> None:
        # Output for a sequence we already finished (abort, stop string): make sure the manager
        # really drops it, since a cancel can race with the request being queued.
        if out.request_id not in self._zombies:
            return
        if out.is_finished():
            self._zombies.pop(out.request_id, None)
        elif self._manager is not None:
            self._manager.cancel_request(out.request_id)

    def _finish_locked(self, seq: _Seq, *, engine_done: bool) -> None:
        self._seqs.pop(seq.seq_id, None)
        self._retire_locked(seq, cancel=not engine_done)


# --------------------------------------------------------------------------------------------
# Static size-or-time micro-batches (the baseline)
# --------------------------------------------------------------------------------------------


class _RowSampler(LogitsProcessor):
    """Per-row sampling inside a padded model.generate: same maths as the CB processors."""

    def __init__(self, rows: list[_Seq], input_len: int, device: torch.device) -> None:
        self._input_len = input_len
        self._seeds = [r.noise_seed for r in rows]
        self._base = [len(r.input_ids) for r in rows]
        self._sampled = any(s is not None for s in self._seeds)
        self._temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        self._top_k = torch.tensor([r.params.top_k for r in rows], device=device)
        self._top_p = torch.tensor([r.params.top_p for r in rows], device=device)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self._sampled:
            return scores  # all greedy: generate's argmax is exactly what we want
        generated = input_ids.shape[1] - self._input_len
        keys = sample_keys(self._seeds, [b + generated for b in self._base])
        out = apply_temperature(scores.float(), self._temperature)
        out = apply_top_k(out, self._top_k)
        out = apply_top_p(out, self._top_p)
        out = add_gumbel_noise(out, torch.tensor(keys, device=scores.device))
        return out  # type: ignore[return-value]


class _RowStopper(StoppingCriteria):
    """Called after every generate step: streams each row's token, decides per-row stops."""

    def __init__(self, engine: HFStaticEngine, rows: list[_Seq]) -> None:
        self._engine = engine
        self._rows = rows
        self.done = [False] * len(rows)

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        last = input_ids[:, -1].tolist()
        self._engine._on_static_step(self._rows, self.done, last)
        return torch.tensor(self.done, device=input_ids.device)  # type: ignore[return-value]


class HFStaticEngine(_HFEngineBase):
    """Static batching: wait for `batch_size` requests or `batch_timeout_ms` after the first,
    then run one left-padded `model.generate` for the batch; later arrivals wait for the next.

    Tokens still stream per step. `max_seqs` (default 2 * batch_size) lets the next batch queue
    up while one runs.
    """

    name = "hf-static"

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny",
        *,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 8,
        batch_timeout_ms: float = 20.0,
        max_seqs: int | None = None,
        max_tokens: int = 65536,
        attn_implementation: str = "sdpa",
        seed: int = 0,
        threads: int | None = None,
    ) -> None:
        super().__init__(
            model,
            device=device,
            dtype=dtype,
            max_seqs=max_seqs if max_seqs is not None else 2 * batch_size,
            max_tokens=max_tokens,
            attn_implementation=attn_implementation,
            seed=seed,
            threads=threads,
        )
        self.batch_size = batch_size
        self.batch_timeout = batch_timeout_ms / 1000.0
        self._cond = threading.Condition(self._lock)
        self._arrival: dict[str, float] = {}
        self._thread: threading.Thread | None = None

    async def start(self) -> None:
        if self._started:
            return
        self._channel.bind(asyncio.get_running_loop())
        model = await asyncio.to_thread(self._load_model)
        # Per-row EOS handling is ours (ignore_eos differs per row), so generate must not stop
        # rows on EOS by itself; padding uses the pad id.
        model.generation_config.eos_token_id = None
        with self._lock:
            self._started = True
        self._thread = threading.Thread(target=self._loop, name="tokenyard-hf-static", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        with self._lock:
            left = list(self._seqs.values())
            self._seqs.clear()
            self._pending.clear()
            self._stats.running = 0
        self._channel.publish([s.finish(FinishReason.ERROR, "engine stopped") for s in left])
        self._channel.close()

    def add(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        seq = self._make_seq(seq_id, prompt_token_ids, params, resume_token_ids)
        with self._cond:
            if self._enqueue(seq):
                self._arrival[seq_id] = time.monotonic()
                self._cond.notify_all()

    def abort(self, seq_id: str) -> None:
        with self._cond:
            seq = self._seqs.pop(seq_id, None)
            if seq is None:
                return
            seq.aborted = True  # a running row stops at the next step; its batch slot stays used
            if seq in self._pending:
                self._pending.remove(seq)
            self._arrival.pop(seq_id, None)
            self._channel.publish([seq.finish(FinishReason.CANCELLED)])

    def _next_batch(self) -> list[_Seq] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._pending:
                    first = self._arrival.get(self._pending[0].seq_id, time.monotonic())
                    wait = first + self.batch_timeout - time.monotonic()
                    if len(self._pending) >= self.batch_size or wait <= 0:
                        break
                    self._cond.wait(wait)
                else:
                    self._cond.wait()
            batch = [
                self._pending.popleft() for _ in range(min(self.batch_size, len(self._pending)))
            ]
            for seq in batch:
                self._arrival.pop(seq.seq_id, None)
            self._stats.running = len(batch)
            return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run_batch(batch)
            except Exception as exc:  # a failed batch fails its rows, not the engine
                with self._lock:
                    failed = [s for s in batch if self._seqs.get(s.seq_id) is s]
                    for s in failed:
                        self._seqs.pop(s.seq_id, None)
                    outs = [
                        s.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}") for s in failed
                    ]
                    self._channel.publish(outs)
            finally:
                with self._lock:
                    self._stats.running = 0

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Seq]) -> None:
        assert self.model is not None
        width = max(len(s.input_ids) for s in batch)
        pad = self.tokenizer.pad_token_id
        ids = [[pad] * (width - len(s.input_ids)) + s.input_ids for s in batch]
        mask = [[0] * (width - len(s.input_ids)) + [1] * len(s.input_ids) for s in batch]
        input_ids = torch.tensor(ids, device=self.device)
        attention_mask = torch.tensor(mask, device=self.device)
        stopper = _RowStopper(self, batch)
        generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,
            max_new_tokens=max(s.decoder.remaining for s in batch),
            pad_token_id=pad,
        )
        self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            logits_processor=LogitsProcessorList([_RowSampler(batch, width, self.device)]),
            stopping_criteria=StoppingCriteriaList([stopper]),
        )
        with self._lock:
            # Rows generate cannot have left open (defensive: every row has its own limit).
            outs: list[StepOutput] = []
            for i, seq in enumerate(batch):
                if not stopper.done[i] and self._seqs.get(seq.seq_id) is seq:
                    self._seqs.pop(seq.seq_id, None)
                    outs.append(seq.output(seq.decoder.close(FinishReason.LENGTH)))
            self._channel.publish(outs)

    def _on_static_step(self, rows: list[_Seq], done: list[bool], last: list[int]) -> None:
        outs: list[StepOutput] = []
        stepped = 0
        with self._lock:
            for i, seq in enumerate(rows):
                if done[i]:
                    continue
                if seq.aborted or self._closed:  # stop() ends the batch early
                    done[i] = True
                    continue
                stepped += 1
                delta = seq.decoder.feed([last[i]])
                self._stats.tokens_generated += len(delta.token_ids)
                outs.append(seq.output(delta))
                if delta.finish_reason is not None:
                    done[i] = True
                    self._seqs.pop(seq.seq_id, None)
            if stepped:
                self._stats.steps += 1
                self._stats.sequences_stepped += stepped
            self._stats.running = len(rows) - sum(done)
            self._channel.publish(outs)
