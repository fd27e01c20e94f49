"""Engines whose runtime is asyncio-native (vLLM's AsyncLLM, an HTTP upstream): one task per
sequence (or embeddings job) on the worker's event loop, outputs of one loop iteration coalesced
into one delivery.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenyard import limits
from tokenyard.engines.base import Engine, EngineRequest, OutputChannel, StepOutput
from tokenyard.engines.detok import SequenceDecoder
from tokenyard.engines.hf_tokenizer import HFTokenizer
from tokenyard.engines.pooling import split_inputs
from tokenyard.errors import EngineError, InvalidRequest
from tokenyard.messages import (
    EngineStats,
    FinishReason,
    PoolingOptions,
    PromptLogprob,
    SamplingParams,
    TokenLogprob,
)

log = logging.getLogger(__name__)


@dataclass
class StreamSeq:
    """One sequence: its prompt, the decoder that applies its params, and its task; or one
    embeddings job: its `inputs` and no decoder."""

    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    decoder: SequenceDecoder | None
    priority: int
    generated: list[int] = field(default_factory=list)  # resumed + produced so far
    inputs: list[list[int]] | None = None  # an embeddings job's inputs (`prompt_ids`, split)
    pooling: PoolingOptions | None = None  # an embeddings job's options
    extra: Any = None  # what the subclass prepared in `prepare`
    # the prompt's logprobs once the runtime gave them; its next output carries them
    prompt_logprobs: list[PromptLogprob] | None = None
    prompt_logprobs_sent: bool = False
    task: asyncio.Task[None] | None = None
    done: bool = False
    cached_tokens: int | None = None  # what the runtime's prefix cache held of its prompt
    adapter: str | None = None  # the LoRA adapter it runs with (None: the base)
    adapter_path: str = ""  # where to load it from, when the engine was not given it

    @property
    def remaining(self) -> int:
        """Tokens it may still generate before LENGTH (none for an embeddings job)."""
        return self.decoder.remaining if self.decoder is not None else 0


class StreamEngine(Engine):
    """Base for engines that run each sequence as a coroutine; subclasses implement `generate`.

    `add` validates synchronously (so refusals raise in the caller) and hands the sequence to
    the loop; `abort` cancels the task, which is how the runtime learns to stop it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seqs: dict[str, StreamSeq] = {}
        self._early: list[StreamSeq] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channel = OutputChannel()
        self._pending: list[StepOutput] = []
        self._flush_scheduled = False
        self._stats = EngineStats()
        self._stopping = False

    # -- subclass hooks ---------------------------------------------------------------------
    tokenizer: HFTokenizer

    def make_decoder(
        self, prompt_ids: list[int], params: SamplingParams, resume_ids: Sequence[int]
    ) -> SequenceDecoder:
        """Check the request by the one rule (raises InvalidRequest) and build its decoder."""
        limits.check(limits.refusal(len(prompt_ids), params, self.limits(), token_ids=prompt_ids))
        tok = self.tokenizer
        return SequenceDecoder(
            tok.decode,
            params,
            prompt_ids=prompt_ids,
            eos_token_ids=tok.eos_token_ids,
            resume_ids=resume_ids,
        )

    def prepare(self, seq: StreamSeq) -> Any:
        """Runtime-specific request data built in `add` (so its errors reach the caller)."""
        return None

    @abc.abstractmethod
    async def generate(self, seq: StreamSeq) -> None:
        """Run the sequence, calling `feed` with new token ids and `close` at the end."""

    async def embed(self, seq: StreamSeq) -> list[bytes]:
        """An embeddings job's vectors, one per input (float32, little-endian); only engines
        whose `limits()` say they embed are asked. InvalidRequest: the job is at fault."""
        raise EngineError(f"the {self.name} engine does not embed")

    async def open(self) -> None:
        """Start the runtime (called by `start`, on the loop)."""

    async def close_runtime(self) -> None:
        """Shut the runtime down (called by `stop` once every sequence ended)."""

    # -- Engine -----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._loop is not None:
            return
        await self.open()
        loop = asyncio.get_running_loop()
        self._channel.bind(loop)
        with self._lock:
            self._loop = loop
            early, self._early = self._early, []
        for seq in early:
            self._launch(seq)

    async def stop(self) -> None:
        with self._lock:
            self._stopping = True
            left = list(self._seqs.values())
        tasks = [s.task for s in left if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for seq in left:
            self._emit(seq, [], "", FinishReason.ERROR, "engine stopped")
        self._flush()
        await self.close_runtime()
        self._channel.close()

    def add(self, request: EngineRequest) -> None:
        seq_id, prompt, params = request.seq_id, request.prompt_token_ids, request.params
        if request.input_lengths is None:
            decoder = self.make_decoder(prompt, params, request.resume_token_ids)
            resumed = list(request.resume_token_ids)
            seq = StreamSeq(seq_id, list(prompt), params, decoder, int(request.priority), resumed)
            seq.adapter, seq.adapter_path = request.adapter, request.adapter_path
            seq.extra = self.prepare(seq)
        else:
            seq = StreamSeq(seq_id, list(prompt), params, None, int(request.priority))
            seq.inputs = split_inputs(prompt, request.input_lengths, self.limits(), request.pooling)
            seq.pooling = request.pooling
        with self._lock:
            if self._stopping:
                raise EngineError("engine is stopped")
            if seq_id in self._seqs:
                raise EngineError(f"sequence {seq_id!r} is already in the engine")
            self._seqs[seq_id] = seq
            loop = self._loop
            if loop is None:
                self._early.append(seq)
        if loop is not None:
            loop.call_soon_threadsafe(self._launch, seq)

    def abort(self, seq_id: str) -> None:
        with self._lock:
            seq = self._seqs.get(seq_id)
            loop = self._loop
            if seq is not None and loop is None:
                self._early.remove(seq)
        if seq is None:
            return
        if loop is None:
            self._emit(seq, [], "", FinishReason.CANCELLED)
            return
        loop.call_soon_threadsafe(self._cancel, seq)

    async def outputs(self) -> list[StepOutput]:
        return await self._channel.get()

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            return EngineStats(s.steps, s.sequences_stepped, s.tokens_generated, len(self._seqs))

    # -- for subclasses, on the loop --------------------------------------------------------
    def feed(
        self,
        seq: StreamSeq,
        ids: Sequence[int],
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> None:
        """New tokens from the runtime (and, when the params ask, one logprob per id); stop
        strings, EOS and the length limit apply here."""
        if seq.done or not ids or seq.decoder is None:
            return
        seq.generated += ids
        delta = seq.decoder.feed(ids)
        with self._lock:
            self._stats.tokens_generated += len(delta.token_ids)
        kept = None
        if logprobs is not None:
            # the decoder keeps a prefix of the ids (none after a stop): their logprobs with them
            kept = list(logprobs[: len(delta.token_ids)])
            if len(kept) != len(delta.token_ids):
                raise EngineError(
                    f"{len(logprobs)} logprobs for {len(ids)} tokens of sequence {seq.seq_id!r}"
                )
        self._emit(seq, delta.token_ids, delta.text, delta.finish_reason, logprobs=kept)

    def close(self, seq: StreamSeq, reason: FinishReason) -> None:
        """The runtime ended the sequence (EOS, length) without our decoder having seen it."""
        if seq.done or seq.decoder is None:
            return
        delta = seq.decoder.close(reason)
        self._emit(seq, [], delta.text, delta.finish_reason)

    def fail(self, seq: StreamSeq, error: str, *, refused: bool = False) -> None:
        """End the sequence with ERROR; `refused`: the request is at fault, do not retry it."""
        self._emit(seq, [], "", FinishReason.ERROR, error, refused)

    # -- internals --------------------------------------------------------------------------
    def _launch(self, seq: StreamSeq) -> None:
        if seq.done:
            return
        if seq.decoder is not None and seq.decoder.finish_reason is not None:
            # The resumed tokens already complete the sequence: nothing left to run.
            self._emit(seq, [], "", seq.decoder.finish_reason)
            return
        run = self._run(seq) if seq.inputs is None else self._run_embed(seq)
        seq.task = asyncio.get_running_loop().create_task(run)

    def _cancel(self, seq: StreamSeq) -> None:
        if seq.done:
            return
        if seq.task is not None:
            seq.task.cancel()
        self._emit(seq, [], "", FinishReason.CANCELLED)

    async def _run(self, seq: StreamSeq) -> None:
        try:
            await self.generate(seq)
            if not seq.done:
                self.fail(seq, f"{self.name} engine: the sequence ended without a finish reason")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one broken sequence fails alone; the worker goes on
            log.exception("%s sequence %s failed", self.name, seq.seq_id)
            self.fail(seq, f"{self.name} engine: {exc}")

    async def _run_embed(self, seq: StreamSeq) -> None:
        try:
            vectors = await self.embed(seq)
        except asyncio.CancelledError:
            raise
        except InvalidRequest as exc:  # the job itself is at fault: no retry
            self.fail(seq, str(exc), refused=True)
            return
        except Exception as exc:  # one broken job fails alone; the worker goes on
            log.exception("%s embeddings job %s failed", self.name, seq.seq_id)
            self.fail(seq, f"{self.name} engine: {exc}")
            return
        self._emit(seq, [], "", FinishReason.STOP, embeddings=vectors)

    def _emit(
        self,
        seq: StreamSeq,
        ids: list[int],
        text: str,
        reason: FinishReason | None,
        error: str | None = None,
        refused: bool = False,
        embeddings: list[bytes] | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> None:
        if seq.done:
            return
        if reason is not None:
            seq.done = True
            with self._lock:
                self._seqs.pop(seq.seq_id, None)
        prompt_logprobs = None
        if seq.prompt_logprobs is not None and not seq.prompt_logprobs_sent:
            prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
        self._pending.append(
            StepOutput(
                seq_id=seq.seq_id,
                token_ids=ids,
                text=text,
                finish_reason=reason,
                prompt_tokens=len(seq.prompt_ids),
                completion_tokens=seq.decoder.completion_tokens if seq.decoder else 0,
                error=error,
                refused=refused,
                embeddings=embeddings,
                logprobs=logprobs,
                cached_tokens=seq.cached_tokens,
                prompt_logprobs=prompt_logprobs,
            )
        )
        if self._loop is None:
            self._flush()
        elif not self._flush_scheduled:
            # Everything produced in this loop iteration goes out in one delivery.
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        outs, self._pending = self._pending, []
        if not outs:
            return
        with self._lock:
            self._stats.steps += 1
            self._stats.sequences_stepped += len(outs)
        self._channel.deliver(outs)


NOT_REPEATED = (
    "asked again from its prompt, the runtime does not repeat the tokens already sent, and its "
    "guide or penalties depend on them"
)


def replayed_tail(
    expected: list[int], ids: list[int], logprobs: list[TokenLogprob] | None
) -> tuple[list[int], list[TokenLogprob] | None] | None:
    """Of a sequence asked again from its prompt, the new ids past those already sent (each
    consumed from `expected`); None when they differ from what was sent, whose continuation
    would then not follow what the client has."""
    n = min(len(expected), len(ids))
    if ids[:n] != expected[:n]:
        return None
    del expected[:n]
    return ids[n:], logprobs[n:] if logprobs is not None else None
