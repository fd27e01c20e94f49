"""The static micro-batch baseline: one left-padded `model.generate` per size-or-time batch."""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from typing import Any, Unpack

import msgspec
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from tokenyard.engines.base import EngineCapacity, EngineRequest, StepOutput
from tokenyard.engines.detok import Delta
from tokenyard.engines.hf import HFEngineBase, HFLoadOptions, HFSeq
from tokenyard.engines.sampling import (
    AdjustBuffers,
    LogprobBuffers,
    process_rows,
    sample_keys,
)
from tokenyard.messages import EngineStats, Feature, FinishReason, TokenLogprob


class _RowSampler(LogitsProcessor):
    """Per-row sampling inside a padded model.generate: the same maths as continuous batching,
    penalties, bias, masks and logprobs included (each row's features are advanced by the
    stopper, which generate calls after each token)."""

    def __init__(self, rows: list[HFSeq], input_len: int, vocab: int, device: torch.device) -> None:
        self._input_len = input_len
        self._seeds = [r.noise_seed for r in rows]
        self._base = [len(r.input_ids) for r in rows]
        self._sampled = any(s is not None for s in self._seeds)
        self._temperature = torch.tensor([r.params.temperature for r in rows], device=device)
        self._top_k = torch.tensor([r.params.top_k for r in rows], device=device)
        self._top_p = torch.tensor([r.params.top_p for r in rows], device=device)
        self._min_p = torch.tensor([r.params.min_p for r in rows], device=device)
        self._features = [(i, r.features) for i, r in enumerate(rows) if r.features is not None]
        self._adjust = AdjustBuffers(len(rows), vocab, device) if self._features else None
        want = any(f.logprobs is not None for _, f in self._features)
        self.logprobs = LogprobBuffers(len(rows), vocab, device) if want else None
        self.done = [False] * len(rows)  # the stopper's: finished rows are left as they are

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        raw: torch.Tensor = scores
        out: torch.Tensor = scores
        if self._adjust is not None:
            adjust = [(i, f) for i, f in self._features if f.adjusts and not self.done[i]]
            if adjust or self._adjust.dirty:
                self._adjust.fill(adjust)
                out = self._adjust.apply(out)
        if self._sampled:
            generated = input_ids.shape[1] - self._input_len
            keys = sample_keys(self._seeds, [b + generated for b in self._base])
            out = process_rows(
                out,
                self._temperature,
                self._top_k,
                self._top_p,
                torch.tensor(keys, device=scores.device),
                self._min_p,
            )
        # all greedy: generate's argmax of `out` is exactly what we want
        if self.logprobs is not None:
            self.logprobs.record(raw, out)
        return out  # type: ignore[return-value]


class _RowStopper(StoppingCriteria):
    """Called after every generate step: streams each row's token, decides per-row stops."""

    def __init__(self, engine: HFStaticEngine, rows: list[HFSeq], sampler: _RowSampler) -> None:
        self._engine = engine
        self._rows = rows
        self._sampler = sampler
        self.done = sampler.done

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        last = input_ids[:, -1].tolist()
        lp = self._sampler.logprobs
        logprobs = lp.read(len(self._rows)) if lp is not None else None
        self._engine._on_static_step(self._rows, self.done, last, logprobs)
        return torch.tensor(self.done, device=input_ids.device)  # type: ignore[return-value]


class HFStaticEngine(HFEngineBase):
    """Static batching: wait for `batch_size` requests or `batch_timeout_ms` after the first,
    then run one left-padded `model.generate` for the batch; later arrivals wait for the next.

    That queue is this engine's own policy (it is the baseline): `max_seqs` (default
    2 * batch_size) counts queued and running sequences, so the next batch can form while one
    runs. Tokens still stream per step.
    """

    name = "hf-static"
    features = frozenset(Feature)

    def __init__(
        self,
        model: str | os.PathLike[str] = "tiny",
        *,
        batch_size: int = 8,
        batch_timeout_ms: float = 20.0,
        max_seqs: int | None = None,
        max_tokens: int | None = None,
        **load: Unpack[HFLoadOptions],
    ) -> None:
        super().__init__(model, **load)
        seqs = max_seqs if max_seqs is not None else 2 * batch_size
        # generate's cache grows with the batch: every sequence may use the whole context.
        budget = max_tokens if max_tokens is not None else seqs * self.tokenizer.max_model_len
        self.capacity = EngineCapacity(max_seqs=seqs, max_tokens=budget)
        self.batch_size = batch_size
        self.batch_timeout = batch_timeout_ms / 1000.0
        self._queue: deque[HFSeq] = deque()
        self._arrival: dict[str, float] = {}

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
        self._start_thread("tokenyard-hf-static")

    def _close_locked(self) -> list[StepOutput]:
        self._queue.clear()
        return super()._close_locked()

    def add(self, request: EngineRequest) -> None:
        seq = self._open(request)
        with self._cond:
            if self._hold_locked(seq):
                self._queue.append(seq)
                self._arrival[seq.seq_id] = time.monotonic()
                self._cond.notify_all()

    def _abort_locked(self, seq: HFSeq) -> None:
        # A running row stops at the next step; its place in the batch stays used.
        seq.aborted = True
        self._release_locked(seq)
        if seq in self._queue:
            self._queue.remove(seq)
        self._arrival.pop(seq.seq_id, None)

    def stats(self) -> EngineStats:
        with self._lock:
            return msgspec.structs.replace(super().stats(), waiting=len(self._queue))

    def _next_batch(self) -> list[HFSeq] | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                if self._queue:
                    first = self._arrival.get(self._queue[0].seq_id, time.monotonic())
                    wait = first + self.batch_timeout - time.monotonic()
                    if len(self._queue) >= self.batch_size or wait <= 0:
                        break
                    self._cond.wait(wait)
                else:
                    self._cond.wait()
            n = min(self.batch_size, len(self._queue))
            batch = [self._queue.popleft() for _ in range(n)]
            for seq in batch:
                self._arrival.pop(seq.seq_id, None)
            return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run_batch(batch)
            except Exception as exc:  # a failed batch fails its rows, not the engine
                with self._lock:
                    failed = [s for s in batch if self._release_locked(s)]
                    error = f"{type(exc).__name__}: {exc}"
                    self._deliver([s.finish(FinishReason.ERROR, error) for s in failed])

    @torch.inference_mode()
    def _run_batch(self, batch: list[HFSeq]) -> None:
        assert self.model is not None
        width = max(len(s.input_ids) for s in batch)
        pad = self.tokenizer.pad_token_id
        ids = [[pad] * (width - len(s.input_ids)) + s.input_ids for s in batch]
        mask = [[0] * (width - len(s.input_ids)) + [1] * len(s.input_ids) for s in batch]
        input_ids = torch.tensor(ids, device=self.device)
        attention_mask = torch.tensor(mask, device=self.device)
        sampler = _RowSampler(batch, width, self.logits_vocab, self.device)
        stopper = _RowStopper(self, batch, sampler)
        generation_config = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False,
            max_new_tokens=max(s.decoder.remaining for s in batch),
            pad_token_id=pad,
        )
        self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=generation_config,
            logits_processor=LogitsProcessorList([sampler]),
            stopping_criteria=StoppingCriteriaList([stopper]),
        )
        with self._lock:
            # Rows generate cannot have left open (defensive: every row has its own limit).
            outs: list[StepOutput] = []
            for i, seq in enumerate(batch):
                if not stopper.done[i] and self._release_locked(seq):
                    outs.append(seq.output(seq.decoder.close(FinishReason.LENGTH)))
            self._deliver(outs)

    def _on_static_step(
        self,
        rows: list[HFSeq],
        done: list[bool],
        last: list[int],
        logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None,
    ) -> None:
        outs: list[StepOutput] = []
        stepped = 0
        self._prepare_prompt_logprobs([s for i, s in enumerate(rows) if not done[i]])
        with self._lock:
            for i, seq in enumerate(rows):
                if done[i]:
                    continue
                if seq.aborted or self._closed:  # stop() ends the batch early
                    done[i] = True
                    continue
                stepped += 1
                error, complete = self._features_update(seq, [last[i]])
                if error is not None:
                    done[i] = True
                    self._release_locked(seq)
                    outs.append(seq.finish(FinishReason.ERROR, error))
                    continue
                delta = seq.decoder.feed([last[i]])
                if complete and delta.finish_reason is None:
                    tail = seq.decoder.close(FinishReason.STOP)
                    delta = Delta(delta.token_ids, delta.text + tail.text, tail.finish_reason)
                self._stats.tokens_generated += len(delta.token_ids)
                output = self._with_prompt_logprobs(seq, seq.output(delta))
                k = seq.params.logprobs
                if k is not None and delta.token_ids and logprobs is not None:
                    chosen, value, top = logprobs[i]
                    output.logprobs = [TokenLogprob(chosen, value, tuple(top[:k]))]
                outs.append(output)
                if delta.finish_reason is not None:
                    done[i] = True
                    self._release_locked(seq)
            if stepped:
                self._stats.steps += 1
                self._stats.sequences_stepped += stepped
            self._deliver(outs)
