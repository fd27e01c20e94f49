"""transformers embeddings and cross-encoder scores: many inputs, of one job or several, in one
forward pass.

An embedding model is loaded as `AutoModel` (a BERT-style encoder, or a causal LM's base model)
and each input's vector is pooled from its last hidden state as the directory's
sentence-transformers files say (modules.json, 1_Pooling/config.json): mean over the attention
mask by default, L2-normalised when the directory has a Normalize module or has no
sentence-transformers files; a job's options shorten (matryoshka) and normalise it as vLLM does.

A cross-encoder (a `*ForSequenceClassification` directory with one label) is loaded as such and
each input, a (query, document) pair, gets its one logit through the activation vLLM and
sentence-transformers apply: the config's `sentence_transformers.activation_fn` (or
`sbert_ce_default_activation_function`), else a sigmoid.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
from transformers import AutoModel, AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

from tokenyard import limits
from tokenyard.engines.base import (
    EngineCapacity,
    EngineRequest,
    StepOutput,
    ThreadedEngine,
    weights_fingerprint,
)
from tokenyard.engines.hf import resolve_device, resolve_dtype
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path
from tokenyard.engines.pooling import (
    DEFAULT_TOKEN_BUDGET,
    Pooling,
    is_cross_encoder,
    read_matryoshka,
    read_pooling,
    require_one_label,
    split_inputs,
)
from tokenyard.engines.pooling import is_embedding_model as is_embedding_model
from tokenyard.errors import EngineError
from tokenyard.messages import FinishReason, ModelLimits, PoolingOptions

log = logging.getLogger(__name__)

CPU_MAX_BATCH_TOKENS = 16384  # padded tokens per forward pass
CUDA_MAX_BATCH_TOKENS = 131072
MAX_BATCH_ROWS = 1024
DEFAULT_MAX_SEQS = 256  # jobs held at once: each holds only its token ids until its pass


def pool(hidden: torch.Tensor, mask: torch.Tensor, how: Pooling) -> torch.Tensor:
    """[batch, dim] vectors of `hidden` [batch, seq, dim] over `mask` [batch, seq] (right-padded),
    in float32."""
    h = hidden.float()
    m = mask.unsqueeze(-1).to(h.dtype)
    if how.mode == "cls":
        out = h[:, 0]
    elif how.mode == "last":
        last = mask.sum(dim=1) - 1
        out = h[torch.arange(h.shape[0], device=h.device), last]
    elif how.mode == "max":
        out = h.masked_fill(m == 0, float("-inf")).max(dim=1).values
    else:
        out = (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(out, p=2, dim=1) if how.normalize else out


def shaped(vectors: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Pooled `vectors` [batch, dim] as a job's options ask: the first `dimensions` values
    (matryoshka), then L2-normalised, in vLLM's order."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return torch.nn.functional.normalize(vectors, p=2, dim=1) if normalize else vectors


def cross_encoder_activation(config: dict[str, Any]) -> torch.nn.Module:
    """The activation a cross-encoder's logit goes through (vLLM's and sentence-transformers'
    reading of its config): a `torch.nn.modules` class the config names, else a sigmoid."""
    name = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function"
    )
    if not name:
        return torch.nn.Sigmoid()
    if not str(name).startswith("torch.nn.modules."):
        # as vLLM: loading an activation is restricted to torch.nn.modules
        raise ValueError(f"activation {name!r} is not a torch.nn.modules class")
    module, _, cls = str(name).rpartition(".")
    made = getattr(importlib.import_module(module), cls)()
    assert isinstance(made, torch.nn.Module)
    return made


@dataclass(eq=False)
class _Job:
    """One request's inputs and the vectors made so far; `next` is its first input not yet in a
    forward pass."""

    seq_id: str
    inputs: list[list[int]]
    tokens: int
    pooling: PoolingOptions
    vectors: list[bytes | None] = field(default_factory=list)
    next: int = 0
    done: int = 0

    def output(self, reason: FinishReason, error: str | None = None) -> StepOutput:
        vectors = None
        if reason is FinishReason.STOP:
            vectors = [v for v in self.vectors if v is not None]
        return StepOutput(
            seq_id=self.seq_id,
            token_ids=[],
            text="",
            finish_reason=reason,
            prompt_tokens=self.tokens,
            completion_tokens=0,
            error=error,
            embeddings=vectors,
        )


class HFEmbedEngine(ThreadedEngine):
    """Embeddings, or a cross-encoder's scores, from a transformers model: every step takes
    inputs in arrival order (several jobs' together) up to `max_batch_tokens` padded tokens,
    and a job ends once all its inputs are pooled. Completions are refused (its limits say it
    does not generate), and so is the task the model has no head for."""

    name = "hf-embed"

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny",
        *,
        device: str = "cpu",
        dtype: str = "auto",
        threads: int | None = None,
        max_seqs: int | None = None,
        max_tokens: int | None = None,
        max_batch_tokens: int | None = None,
    ) -> None:
        super().__init__(
            EngineCapacity(max_seqs or DEFAULT_MAX_SEQS, max_tokens or DEFAULT_TOKEN_BUDGET)
        )
        self.model_path = resolve_model_path(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.threads = threads
        self.pooling = read_pooling(self.model_path)
        self.matryoshka = read_matryoshka(self.model_path)
        self.cross_encoder = is_cross_encoder(self.model_path)
        self._activation: torch.nn.Module | None = None
        kind = f"{self.pooling.mode}:{int(self.pooling.normalize)}"
        if self.cross_encoder:
            config = require_one_label(self.model_path)
            self._activation = cross_encoder_activation(config)
            kind = f"score:{type(self._activation).__name__}"
        self._token_types = False  # the model takes token type ids (BERT's segments)
        self.tokenizer: HFTokenizer = load_hf_tokenizer(self.model_path)
        default_batch = (
            CUDA_MAX_BATCH_TOKENS if self.device.type == "cuda" else CPU_MAX_BATCH_TOKENS
        )
        self.max_batch_tokens = max_batch_tokens or default_batch
        self._jobs: dict[str, _Job] = {}
        self._queue: deque[_Job] = deque()  # jobs with inputs not yet in a forward pass
        self._model: Any = None
        self._limits: ModelLimits | None = None
        self._revision = (
            f"{self.name}:{weights_fingerprint(self.model_path)}:{self.dtype}:{kind}"
        ).replace("torch.", "")

    @property
    def revision(self) -> str:
        return self._revision

    def limits(self) -> ModelLimits:
        if self._limits is None:
            own = super().limits()
            context = min(own.max_model_len, self.pooling.max_seq_length or own.max_model_len)
            if self.cross_encoder:
                self._limits = msgspec.structs.replace(
                    own, max_model_len=context, generates=False, scores=True
                )
            else:
                self._limits = msgspec.structs.replace(
                    own,
                    max_model_len=context,
                    generates=False,
                    embeds=True,
                    matryoshka=self.matryoshka[0],
                    matryoshka_dimensions=self.matryoshka[1],
                )
        return self._limits

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._channel.bind(asyncio.get_running_loop())
        await asyncio.to_thread(self._load)
        self._start_thread("hf-embed")

    def _load(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # process-wide, as the hf engine does
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        kind = AutoModelForSequenceClassification if self.cross_encoder else AutoModel
        model = kind.from_pretrained(self.model_path, dtype=self.dtype, local_files_only=True)
        model.to(self.device)
        model.eval()
        self._token_types = int(getattr(model.config, "type_vocab_size", 0) or 0) > 1
        self._model = model

    def _close_locked(self) -> list[StepOutput]:
        left = [job.output(FinishReason.ERROR, "engine stopped") for job in self._jobs.values()]
        self._jobs.clear()
        self._queue.clear()
        return left + super()._close_locked()

    def add(self, request: EngineRequest) -> None:
        prompt, lengths = request.prompt_token_ids, request.input_lengths
        model_limits = self.limits()
        if lengths is None:  # a completion: the rule refuses it, as this model does not generate
            limits.check(limits.refusal(len(prompt), request.params, model_limits))
            raise EngineError("a completion reached an engine that only embeds")
        pooling = request.pooling or PoolingOptions()
        inputs = split_inputs(prompt, lengths, model_limits, pooling)
        job = _Job(request.seq_id, inputs, len(prompt), pooling, [None] * len(inputs))
        with self._cond:
            if self._closed:
                raise EngineError("engine is stopped")
            self._ledger.take(job.seq_id, job.tokens, self.capacity)
            self._jobs[job.seq_id] = job
            self._queue.append(job)
            self._stats.prefill_tokens += job.tokens
            self._cond.notify()

    def abort(self, seq_id: str) -> None:
        with self._cond:
            job = self._jobs.pop(seq_id, None)
            if job is None:
                return
            self._ledger.give_back(seq_id)
            if job in self._queue:
                self._queue.remove(job)
        self._deliver([job.output(FinishReason.CANCELLED)])

    def _take_batch_locked(self) -> list[tuple[_Job, int]]:
        """Inputs in arrival order while the padded batch fits `max_batch_tokens` (one always)."""
        batch: list[tuple[_Job, int]] = []
        longest = 0
        while self._queue and len(batch) < MAX_BATCH_ROWS:
            job = self._queue[0]
            n = len(job.inputs[job.next])
            if batch and (len(batch) + 1) * max(longest, n) > self.max_batch_tokens:
                break
            batch.append((job, job.next))
            longest = max(longest, n)
            job.next += 1
            if job.next == len(job.inputs):
                self._queue.popleft()
        return batch

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._wait_locked(self._queue):
                    return
                batch = self._take_batch_locked()
            inputs = [job.inputs[i] for job, i in batch]
            how = [job.pooling for job, _ in batch]
            try:
                if self.cross_encoder:
                    seconds = [job.pooling.second[i] for job, i in batch]
                    vectors = self.score(inputs, seconds, how)
                else:
                    vectors = self.embed(inputs, how)
            except Exception as exc:  # a fault of this pass: its jobs are retried elsewhere
                log.exception("embedding pass failed")
                self._fail({job.seq_id: job for job, _ in batch}.values(), exc)
                continue
            outputs: list[StepOutput] = []
            with self._cond:
                self._stats.steps += 1
                self._stats.sequences_stepped += len(batch)
                for (job, i), vector in zip(batch, vectors, strict=True):
                    if self._jobs.get(job.seq_id) is not job:
                        continue  # aborted meanwhile
                    job.vectors[i] = vector
                    job.done += 1
                    if job.done == len(job.inputs):
                        del self._jobs[job.seq_id]
                        self._ledger.give_back(job.seq_id)
                        outputs.append(job.output(FinishReason.STOP))
            self._deliver(outputs)

    def _fail(self, jobs: Iterable[_Job], exc: Exception) -> None:
        outputs: list[StepOutput] = []
        with self._cond:
            for job in jobs:
                if self._jobs.pop(job.seq_id, None) is job:
                    self._ledger.give_back(job.seq_id)
                    if job in self._queue:
                        self._queue.remove(job)
                    outputs.append(job.output(FinishReason.ERROR, f"{type(exc).__name__}: {exc}"))
        self._deliver(outputs)

    def _padded(self, inputs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`inputs` right-padded, and their attention mask, on the model's device."""
        longest = max(len(ids) for ids in inputs)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(inputs), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1
        return ids.to(self.device), mask.to(self.device)

    @torch.inference_mode()
    def embed(
        self, inputs: list[list[int]], how: Sequence[PoolingOptions] | None = None
    ) -> list[bytes]:
        """One forward pass over `inputs` (right-padded): each one's vector, float32 LE bytes,
        shaped as its job's options (`how`, one per input; None: the model's defaults) ask."""
        ids, mask = self._padded(inputs)
        hidden = self._model(input_ids=ids, attention_mask=mask).last_hidden_state
        raw = pool(hidden, mask, msgspec.structs.replace(self.pooling, normalize=False))
        out: list[bytes] = []
        for row, options in enumerate(how or [PoolingOptions()] * len(inputs)):
            normalize = self.pooling.normalize if options.normalize is None else options.normalize
            vector = shaped(raw[row : row + 1], normalize, options.dimensions)
            out.append(np.ascontiguousarray(vector[0].cpu().numpy(), dtype="<f4").tobytes())
        return out

    @torch.inference_mode()
    def score(
        self, inputs: list[list[int]], seconds: Sequence[int], how: Sequence[PoolingOptions]
    ) -> list[bytes]:
        """One forward pass of a cross-encoder over pairs (`inputs`, right-padded; each pair's
        second text starts at its `seconds`): each one's score as one float32 (LE bytes),
        through the activation unless its job's options turn it off."""
        assert self._activation is not None, "not a cross-encoder"
        ids, mask = self._padded(inputs)
        extra: dict[str, torch.Tensor] = {}
        if self._token_types:
            types = torch.zeros_like(ids)
            for row, (tokens, start) in enumerate(zip(inputs, seconds, strict=True)):
                types[row, start : len(tokens)] = 1
            extra["token_type_ids"] = types
        logits = self._model(input_ids=ids, attention_mask=mask, **extra).logits[:, 0].float()
        active = torch.tensor([o.activation for o in how], device=logits.device)
        scores = torch.where(active, self._activation(logits), logits).cpu().numpy()
        return [np.asarray([s], dtype="<f4").tobytes() for s in scores]
