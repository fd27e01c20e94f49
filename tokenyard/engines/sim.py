"""Cost-model engine: real continuous-batching control flow, simulated model time, fake tokens."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenyard.engines.base import EngineCapacity, EngineRequest, EngineSeq, LocalEngine, open_seq
from tokenyard.messages import FinishReason

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

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        # tools and calls as Hermes writes them, so the gateway reads its calls as hermes
        head = f"<tools>{json.dumps(list(tools))}</tools>\n" if tools else ""
        turns = "".join(f"<{m['role']}>{m['content']}{_calls(m)}\n" for m in messages)
        return f"{head}{turns}<assistant>"

    @property
    def chat_template(self) -> str:
        return "<tools>..</tools> <tool_call>{name, arguments}</tool_call>"


def _calls(message: Mapping[str, Any]) -> str:
    return "".join(
        f"<tool_call>{json.dumps(c['function'])}</tool_call>"
        for c in message.get("tool_calls") or ()
    )


@dataclass(eq=False)
class _SimSeq(EngineSeq):
    key: bytes = b""  # hash of prompt (and seed when sampling): tokens depend on it and position
    position: int = 0  # absolute index of the next token
    fail: bool = False
    prefilled: bool = False


class PrefixCache:
    """An LRU of prompt blocks, as vLLM's automatic prefix caching: a block is named by the hash
    of every token up to its end, so a hit is always a whole leading run of blocks. As in vLLM,
    a prompt's blocks are freed last-first, so eviction eats a prefix from its tail and what is
    left still hits."""

    def __init__(self, capacity_tokens: int, block: int = 16) -> None:
        self.block = block
        self.capacity = capacity_tokens // block  # blocks held
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, token_ids: Sequence[int]) -> int:
        """Tokens of `token_ids` already cached (its leading whole blocks); then its blocks are
        cached, its first block the most recently used."""
        if self.capacity <= 0:
            return 0
        digest = hashlib.blake2b(digest_size=16)
        hit, missed, names = 0, False, []
        for end in range(self.block, len(token_ids) + 1, self.block):
            digest.update(
                b"".join(t.to_bytes(4, "little") for t in token_ids[end - self.block : end])
            )
            name = digest.copy().digest()
            if not missed and name in self._blocks:
                hit = end
            else:
                missed = True
            names.append(name)
        for name in reversed(names):  # the first block ends most recently used
            self._blocks[name] = None
            self._blocks.move_to_end(name)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
        return hit


class SimEngine(LocalEngine[_SimSeq]):
    """Prefill costs a + b·prompt_tokens, a decode step c + d·batch; tokens hash prompt+position.

    With `prefix_cache_tokens` > 0 the engine keeps an LRU prefix cache of that many tokens and a
    cached leading run of blocks costs nothing to prefill (prefix affinity's engine).

    Tokens depend only on the prompt and position (and seed when sampling), so resuming from
    prompt + generated tokens reproduces an uninterrupted run exactly.
    """

    name = "sim"

    def __init__(
        self,
        *,
        max_seqs: int | None = None,
        max_tokens: int | None = None,
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
        prefix_cache_tokens: int = 0,
    ) -> None:
        seqs = 64 if max_seqs is None else max_seqs
        # No memory to size from: by default every sequence may use the whole context.
        budget = seqs * max_model_len if max_tokens is None else max_tokens
        super().__init__(EngineCapacity(max_seqs=seqs, max_tokens=budget))
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
        self.prefix_cache = PrefixCache(prefix_cache_tokens)

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._channel.bind(asyncio.get_running_loop())
        self._thread = threading.Thread(target=self._loop, name="tokenyard-sim-engine", daemon=True)
        self._thread.start()

    def add(self, request: EngineRequest) -> None:
        tok = self.tokenizer
        prompt = request.prompt_token_ids
        digest = hashlib.blake2b(digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little") for t in prompt))
        seq = open_seq(
            _SimSeq,
            request,
            decode=tok.decode,
            eos_token_ids=(tok.EOS,),
            model_limits=self.limits(),
        )
        if seq.noise_seed is not None:
            digest.update(seq.noise_seed.to_bytes(8, "little", signed=True))
        seq.key = digest.digest()
        seq.position = len(seq.input_ids)
        marker = self.fail_marker
        seq.fail = bool(marker and marker in tok.decode(prompt))
        with self._cond:
            if self._hold_locked(seq):
                self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._seqs:
                    self._cond.wait()
                if self._closed:
                    return
                batch = list(self._seqs.values())
                started = [s for s in batch if not s.prefilled]
                for s in started:
                    s.prefilled = True
            if started:
                prompt = sum(len(s.input_ids) for s in started)
                hits = sum(self.prefix_cache.lookup_and_insert(s.input_ids) for s in started)
                with self._lock:
                    self._stats.prefix_cache_queries += prompt
                    self._stats.prefix_cache_hits += hits
                self._sleep(self.prefill_base + self.prefill_per_token * (prompt - hits))
            self._sleep(self.decode_base + self.decode_per_seq * len(batch))
            with self._cond:
                self._step_locked(batch)

    def _step_locked(self, batch: list[_SimSeq]) -> None:
        outputs = []
        stepped = 0
        for seq in batch:
            if self._seqs.get(seq.seq_id) is not seq:
                continue  # aborted while the step was "running"
            stepped += 1
            error = None
            if seq.fail:
                error = f"injected failure: prompt contains {self.fail_marker!r}"
            elif self.fail_rate and self._rng.random() < self.fail_rate:
                error = "injected failure (fail_rate)"
            if error is not None:
                self._release_locked(seq)
                outputs.append(seq.finish(FinishReason.ERROR, error))
                continue
            token = self._token(seq)
            seq.position += 1
            delta = seq.decoder.feed([token])
            self._stats.tokens_generated += len(delta.token_ids)
            outputs.append(seq.output(delta))
            if delta.finish_reason is not None:
                self._release_locked(seq)
        if stepped:
            self._stats.steps += 1
            self._stats.sequences_stepped += stepped
        self._deliver(outputs)

    def _token(self, seq: _SimSeq) -> int:
        h = hashlib.blake2b(seq.key + seq.position.to_bytes(4, "little"), digest_size=16).digest()
        pick = int.from_bytes(h[:8], "little")
        eos_draw = int.from_bytes(h[8:], "little") / _MASK64
        if not seq.params.ignore_eos and eos_draw < self.eos_rate:
            return SimTokenizer.EOS
        return _ALPHABET[pick % len(_ALPHABET)] + SimTokenizer.OFFSET
