"""transformers embeddings: many inputs, of one job or several, pooled in one forward pass.

The model is loaded as `AutoModel` (a BERT-style encoder, or a causal LM's base model) and each
input's vector is pooled from its last hidden state as the directory's sentence-transformers
files say (modules.json, 1_Pooling/config.json): mean over the attention mask by default,
L2-normalised when the directory has a Normalize module or has no sentence-transformers files.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import torch
from transformers import AutoModel
from transformers.utils import logging as hf_logging

from tokenyard import limits
from tokenyard.engines.base import (
    ChannelEngine,
    EngineCapacity,
    EngineRequest,
    StepOutput,
    weights_fingerprint,
)
from tokenyard.engines.hf import resolve_device, resolve_dtype
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path
from tokenyard.engines.pooling import DEFAULT_TOKEN_BUDGET, Pooling, read_pooling, split_inputs
from tokenyard.engines.pooling import is_embedding_model as is_embedding_model
from tokenyard.errors import EngineError
from tokenyard.messages import FinishReason, ModelLimits

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


@dataclass(eq=False)
class _Job:
    """One request's inputs and the vectors made so far; `next` is its first input not yet in a
    forward pass."""

    seq_id: str
    inputs: list[list[int]]
    tokens: int
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


class HFEmbedEngine(ChannelEngine):
    """Embeddings from a transformers model: every step takes inputs in arrival order (several
    jobs' together) up to `max_batch_tokens` padded tokens, and a job ends once all its inputs
    are pooled. Completions are refused (its limits say it does not generate)."""

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
        self.tokenizer: HFTokenizer = load_hf_tokenizer(self.model_path)
        default_batch = (
            CUDA_MAX_BATCH_TOKENS if self.device.type == "cuda" else CPU_MAX_BATCH_TOKENS
        )
        self.max_batch_tokens = max_batch_tokens or default_batch
        self._cond = threading.Condition(self._lock)
        self._jobs: dict[str, _Job] = {}
        self._queue: deque[_Job] = deque()  # jobs with inputs not yet in a forward pass
        self._closed = False
        self._thread: threading.Thread | None = None
        self._model: Any = None
        self._limits: ModelLimits | None = None
        self._revision = (
            f"{self.name}:{weights_fingerprint(self.model_path)}:{self.dtype}:"
            f"{self.pooling.mode}:{int(self.pooling.normalize)}"
        ).replace("torch.", "")

    @property
    def revision(self) -> str:
        return self._revision

    def limits(self) -> ModelLimits:
        if self._limits is None:
            own = super().limits()
            context = min(own.max_model_len, self.pooling.max_seq_length or own.max_model_len)
            self._limits = msgspec.structs.replace(
                own, max_model_len=context, generates=False, embeds=True
            )
        return self._limits

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._channel.bind(asyncio.get_running_loop())
        await asyncio.to_thread(self._load)
        self._thread = threading.Thread(target=self._loop, name="hf-embed", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # process-wide, as the hf engine does
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        model = AutoModel.from_pretrained(self.model_path, dtype=self.dtype, local_files_only=True)
        model.to(self.device)
        model.eval()
        self._model = model

    async def stop(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            left = [job.output(FinishReason.ERROR, "engine stopped") for job in self._jobs.values()]
            self._jobs.clear()
            self._queue.clear()
            self._ledger.clear()
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._channel.deliver(left)
        self._channel.close()

    def add(self, request: EngineRequest) -> None:
        prompt, lengths = request.prompt_token_ids, request.input_lengths
        model_limits = self.limits()
        if lengths is None:  # a completion: the rule refuses it, as this model does not generate
            limits.check(limits.refusal(len(prompt), request.params, model_limits))
            raise EngineError("a completion reached an engine that only embeds")
        inputs = split_inputs(prompt, lengths, model_limits)
        job = _Job(request.seq_id, inputs, len(prompt), [None] * len(inputs))
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
        self._channel.deliver([job.output(FinishReason.CANCELLED)])

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
                while not self._closed and not self._queue:
                    self._cond.wait()
                if self._closed:
                    return
                batch = self._take_batch_locked()
            try:
                vectors = self.embed([job.inputs[i] for job, i in batch])
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
            self._channel.deliver(outputs)

    def _fail(self, jobs: Iterable[_Job], exc: Exception) -> None:
        outputs: list[StepOutput] = []
        with self._cond:
            for job in jobs:
                if self._jobs.pop(job.seq_id, None) is job:
                    self._ledger.give_back(job.seq_id)
                    if job in self._queue:
                        self._queue.remove(job)
                    outputs.append(job.output(FinishReason.ERROR, f"{type(exc).__name__}: {exc}"))
        self._channel.deliver(outputs)

    @torch.inference_mode()
    def embed(self, inputs: list[list[int]]) -> list[bytes]:
        """One forward pass over `inputs` (right-padded): each one's vector, float32 LE bytes."""
        longest = max(len(ids) for ids in inputs)
        pad = self.tokenizer.pad_token_id
        ids = torch.full((len(inputs), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(inputs), longest), dtype=torch.long)
        for row, tokens in enumerate(inputs):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        hidden = self._model(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = pool(hidden, mask, self.pooling).cpu().numpy()
        out = np.ascontiguousarray(pooled, dtype="<f4")
        return [row.tobytes() for row in out]
