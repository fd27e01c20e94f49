"""Cost-model engine: real continuous-batching control flow, simulated model time, fake tokens."""

from __future__ import annotations

import asyncio
import hashlib
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tokenyard.engines.base import (
    Engine,
    EngineCapacity,
    EngineStats,
    OutputChannel,
    StepOutput,
    default_seed,
    size_request,
)
from tokenyard.engines.detok import SequenceDecoder
from tokenyard.messages import FinishReason, SamplingParams

# Generated text is drawn from lowercase letters and spaces so it stays readable ASCII.
_ALPHABET = b"etaoinshrdlucmfwypvbgkjqxz     ,."
_MASK64 = (1 << 64) - 1


class SimTokenizer:
    """Byte-level tokenizer: token id = byte + 3; ids 0, 1, 2 are pad, bos and eos."""

    PAD = 0
    BOS = 1
    EOS = 2
    OFFSET = 3
    vocab_size = 256 + OFFSET

    def __init__(self, max_model_len: int = 4096) -> None:
        self._max_model_len = max_model_len

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        turns = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return f"{turns}<assistant>"


class VirtualClock:
    """A clock whose sleep only advances time: fast, deterministic engine tests."""

    def __init__(self, start: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._now = start
        self.sleeps: list[float] = []

    def time(self) -> float:
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds
            self.sleeps.append(seconds)
        time.sleep(0)  # let other threads run, as a real sleep would


@dataclass
class _SimSeq:
    seq_id: str
    prompt_tokens: int
    input_len: int
    decoder: SequenceDecoder
    key: bytes  # hash of the prompt (and seed when sampling): tokens depend on it and position
    position: int  # absolute index of the next token
    reserved: int
    fail: bool


class SimEngine(Engine):
    """Prefill costs a + b·prompt_tokens, a decode step c + d·batch; tokens hash prompt+position.

    Tokens depend only on the prompt and position (and seed when sampling), so resuming from
    prompt + generated tokens reproduces an uninterrupted run exactly.
    """

    name = "sim"

    def __init__(
        self,
        *,
        max_seqs: int = 64,
        max_tokens: int = 1 << 16,
        prefill_base: float = 0.002,
        prefill_per_token: float = 2e-5,
        decode_base: float = 0.01,
        decode_per_seq: float = 5e-4,
        eos_rate: float = 0.0,
        fail_rate: float = 0.0,
        fail_marker: str | None = "[[fail]]",
        seed: int = 0,
        max_model_len: int = 4096,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.capacity = EngineCapacity(max_seqs=max_seqs, max_tokens=max_tokens)
        self.tokenizer: SimTokenizer = SimTokenizer(max_model_len)
        self.prefill_base = prefill_base
        self.prefill_per_token = prefill_per_token
        self.decode_base = decode_base
        self.decode_per_seq = decode_per_seq
        self.eos_rate = eos_rate
        self.fail_rate = fail_rate
        self.fail_marker = fail_marker
        self._rng = random.Random(seed)
        self._sleep = sleep or time.sleep
        self._cond = threading.Condition()
        self._pending: deque[_SimSeq] = deque()
        self._running: dict[str, _SimSeq] = {}
        self._known: set[str] = set()
        self._reserved = 0
        self._stats = EngineStats()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._channel = OutputChannel()

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._channel.bind(asyncio.get_running_loop())
        self._thread = threading.Thread(target=self._loop, name="tokenyard-sim-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        with self._cond:
            left = [*self._running.values(), *self._pending]
            self._running.clear()
            self._pending.clear()
            self._known.clear()
            self._reserved = 0
            self._stats.running = 0
        self._channel.publish([_finish(s, FinishReason.ERROR, "engine stopped") for s in left])
        self._channel.close()

    def add(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        tok = self.tokenizer
        limit, reserved = size_request(
            seq_id, prompt_token_ids, params, tok.max_model_len, self.capacity.max_tokens
        )
        decoder = SequenceDecoder(
            tok.decode,
            params,
            prompt_ids=prompt_token_ids,
            eos_token_ids=(tok.EOS,),
            resume_ids=resume_token_ids,
            limit=limit,
        )
        digest = hashlib.blake2b(digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little") for t in prompt_token_ids))
        if not params.greedy:
            seed = params.seed if params.seed is not None else default_seed(seq_id)
            digest.update(seed.to_bytes(8, "little", signed=True))
        marker = self.fail_marker
        seq = _SimSeq(
            seq_id=seq_id,
            prompt_tokens=len(prompt_token_ids),
            input_len=len(prompt_token_ids) + len(resume_token_ids),
            decoder=decoder,
            key=digest.digest(),
            position=len(prompt_token_ids) + len(resume_token_ids),
            reserved=reserved,
            fail=marker is not None and marker != "" and marker in tok.decode(prompt_token_ids),
        )
        with self._cond:
            if self._stopping:
                raise RuntimeError("engine is stopped")
            if seq_id in self._known:
                raise ValueError(f"sequence {seq_id!r} is already in the engine")
            if decoder.finish_reason is not None:
                # The resumed tokens already complete the sequence: nothing left to run.
                self._publish([_finish(seq, decoder.finish_reason)])
                return
            self._known.add(seq_id)
            self._pending.append(seq)
            self._cond.notify_all()

    def abort(self, seq_id: str) -> None:
        with self._cond:
            seq = self._running.pop(seq_id, None)
            if seq is not None:
                self._reserved -= seq.reserved
            else:
                seq = next((s for s in self._pending if s.seq_id == seq_id), None)
                if seq is None:
                    return
                self._pending.remove(seq)
            self._known.discard(seq_id)
            self._stats.running = len(self._running)
            self._publish([_finish(seq, FinishReason.CANCELLED)])
            self._cond.notify_all()

    async def outputs(self) -> list[StepOutput]:
        return await self._channel.get()

    def stats(self) -> EngineStats:
        with self._cond:
            s = self._stats
            return EngineStats(s.steps, s.sequences_stepped, s.tokens_generated, s.running)

    def _publish(self, outputs: list[StepOutput]) -> None:
        self._channel.publish(outputs)

    def _admit_locked(self) -> list[_SimSeq]:
        admitted: list[_SimSeq] = []
        while self._pending and len(self._running) < self.capacity.max_seqs:
            head = self._pending[0]
            if self._reserved + head.reserved > self.capacity.max_tokens:
                break  # strict FIFO: a long prompt is not overtaken forever by short ones
            self._pending.popleft()
            self._running[head.seq_id] = head
            self._reserved += head.reserved
            admitted.append(head)
        self._stats.running = len(self._running)
        return admitted

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not self._running:
                    self._cond.wait()
                if self._stopping:
                    return
                admitted = self._admit_locked()
                batch = list(self._running.values())
            if admitted:
                prompt = sum(s.input_len for s in admitted)
                self._sleep(self.prefill_base + self.prefill_per_token * prompt)
            self._sleep(self.decode_base + self.decode_per_seq * len(batch))
            with self._cond:
                self._step_locked(batch)

    def _step_locked(self, batch: list[_SimSeq]) -> None:
        outputs: list[StepOutput] = []
        stepped = 0
        for seq in batch:
            if self._running.get(seq.seq_id) is not seq:
                continue  # aborted while the step was "running"
            stepped += 1
            error = None
            if seq.fail:
                error = f"injected failure: prompt contains {self.fail_marker!r}"
            elif self.fail_rate and self._rng.random() < self.fail_rate:
                error = "injected failure (fail_rate)"
            if error is not None:
                self._release_locked(seq)
                outputs.append(_finish(seq, FinishReason.ERROR, error))
                continue
            token = self._token(seq)
            seq.position += 1
            delta = seq.decoder.feed([token])
            self._stats.tokens_generated += len(delta.token_ids)
            outputs.append(
                StepOutput(
                    seq_id=seq.seq_id,
                    token_ids=delta.token_ids,
                    text=delta.text,
                    finish_reason=delta.finish_reason,
                    prompt_tokens=seq.prompt_tokens,
                    completion_tokens=seq.decoder.completion_tokens,
                )
            )
            if delta.finish_reason is not None:
                self._release_locked(seq)
        if stepped:
            self._stats.steps += 1
            self._stats.sequences_stepped += stepped
        self._stats.running = len(self._running)
        self._publish(outputs)
        self._cond.notify_all()

    def _release_locked(self, seq: _SimSeq) -> None:
        del self._running[seq.seq_id]
        self._known.discard(seq.seq_id)
        self._reserved -= seq.reserved

    def _token(self, seq: _SimSeq) -> int:
        h = hashlib.blake2b(seq.key + seq.position.to_bytes(4, "little"), digest_size=16).digest()
        pick = int.from_bytes(h[:8], "little")
        eos_draw = int.from_bytes(h[8:], "little") / _MASK64
        if not seq.decoder.params.ignore_eos and eos_draw < self.eos_rate:
            return SimTokenizer.EOS
        return _ALPHABET[pick % len(_ALPHABET)] + SimTokenizer.OFFSET


def _finish(seq: _SimSeq, reason: FinishReason, error: str | None = None) -> StepOutput:
    return StepOutput(
        seq_id=seq.seq_id,
        token_ids=[],
        text="",
        finish_reason=reason,
        prompt_tokens=seq.prompt_tokens,
        completion_tokens=seq.decoder.completion_tokens,
        error=error,
    )
