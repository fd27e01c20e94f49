"""Cost-model engine: real continuous-batching control flow, simulated model time, fake tokens.

Its "model" is one fixed distribution per position (`SimModel`): its letters, spaces and
punctuation, EOS at `eos_rate`, and a floor for every other byte; each token is a draw from it
keyed by prompt, seed and position. What a request may change in a real model it changes
here too: logit_bias, the penalties and min_tokens reshape that distribution before the draw,
stop_token_ids end the sequence, logprobs (the prompt's too) are the distribution's own
(with `logprobs=True`: see `SimEngine`), and a structured-output
guide makes it write a text in shape (one of the choices, a JSON value of the schema) as a
grammar that allows one token at a time would. Regex and grammar guides it cannot follow: it
refuses them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenyard.engines.badwords import bad_words_token_ids, banned_tokens
from tokenyard.engines.base import (
    ChatRender,
    EngineCapacity,
    EngineRequest,
    EngineSeq,
    EngineTokenizer,
    LocalEngine,
    open_seq,
)
from tokenyard.errors import InvalidRequest
from tokenyard.messages import (
    Feature,
    FinishReason,
    Guide,
    PromptLogprob,
    SamplingParams,
    TokenLogprob,
)

# Generated text is drawn from lowercase letters and spaces so it stays readable ASCII.
_ALPHABET = b"etaoinshrdlucmfwypvbgkjqxz     ,."
_MASK64 = (1 << 64) - 1


class SimTokenizer(EngineTokenizer):
    """Byte-level tokenizer: token id = byte + 3; ids 0, 1, 2 are pad, bos and eos."""

    PAD = 0
    BOS = 1
    EOS = 2
    OFFSET = 3
    vocab_size = 256 + OFFSET

    def __init__(self, max_model_len: int = 4096) -> None:
        self.max_model_len = max_model_len

    @property
    def eos_token_id(self) -> int:
        return self.EOS

    def encode(self, text: str, add_special_tokens: bool | None = None) -> list[int]:
        # its one special token a prompt may start with: BOS, only when asked for
        bos = [self.BOS] if add_special_tokens else []
        return bos + [b + self.OFFSET for b in text.encode("utf-8")]

    def text_of(self, ids: list[int], skip_special: bool, spaces_between_special: bool) -> str:
        # its special tokens' texts have no spaces around them: the second switch changes nothing
        if skip_special:
            data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < self.vocab_size)
            return data.decode("utf-8", errors="replace")
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if self.OFFSET <= i < self.vocab_size:
                run.append(i - self.OFFSET)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(self.token_text(i))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_text(self, token_id: int) -> str:
        if token_id < self.OFFSET:
            return ("<pad>", "<s>", "</s>")[token_id] if token_id >= 0 else ""
        return self.decode([token_id])

    def render_chat(self, chat: ChatRender) -> str:
        messages, tools, variables = chat.messages, chat.tools, chat.variables
        if chat.chat_template is not None:
            # a request's own template, in the sandbox transformers renders templates in
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            return env.from_string(chat.chat_template).render(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=chat.add_generation_prompt,
                **variables,
            )
        # tools and calls as Hermes writes them, so the gateway reads its calls as hermes;
        # thinking turned off closes the reasoning in the prompt, as Qwen3's template does
        head = f"<tools>{json.dumps(list(tools))}</tools>\n" if tools else ""
        turns = "".join(f"<{m['role']}>{m['content']}{_calls(m)}\n" for m in messages)
        if chat.continue_final_message:
            return f"{head}{turns.removesuffix(chr(10))}"  # the last turn left open
        if not chat.add_generation_prompt:
            return f"{head}{turns}"
        closed = "<think>\n\n</think>\n\n" if variables.get("enable_thinking") is False else ""
        return f"{head}{turns}<assistant>{closed}"

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
    prefilled: bool = False  # its whole prompt is in: it decodes
    prefill_done: int = -1  # prompt tokens prefilled so far (-1: not begun)
    priority: int = 0  # its request's (lower first): a capped step prefills in this order
    out_ids: list[int] = field(default_factory=list)  # resumed + generated tokens
    plan: bytes | None = None  # a guided sequence's text, written one byte token at a time
    bad_words: list[tuple[int, ...]] = field(default_factory=list)  # as token sequences
    prompt_logprobs_sent: bool = False  # its first output carries them, when asked

    @property
    def reshaped(self) -> bool:
        """Its draws come from a reshaped distribution (bias, penalties, min_tokens)."""
        p = self.params
        return bool(
            p.logit_bias
            or p.min_tokens
            or p.presence_penalty
            or p.frequency_penalty
            or p.repetition_penalty != 1.0
            or p.min_p
            or p.allowed_token_ids
            or p.bad_words
        )


_FLOOR = -50.0  # every byte outside the alphabet: possible (a bias can force it), never drawn
_LOGIT_SHIFT = 10.0


class SimModel:
    """The sim's next-token distribution, the same at every position: a byte of `_ALPHABET`
    as often as it occurs there, EOS at `eos_rate` (unless the request ignores EOS), and
    every other token at a floor (logit -50) that a logit_bias can lift."""

    def __init__(self, eos_rate: float) -> None:
        self.eos_rate = eos_rate
        self._base = {eos: self._logprobs(eos) for eos in (False, True)}
        self._ranked = {
            eos: sorted(range(SimTokenizer.vocab_size), key=lambda t: (-lp[t], t))
            for eos, lp in self._base.items()
        }

    def _logprobs(self, eos: bool) -> list[float]:
        counts = Counter(_ALPHABET)
        weights = [0.0] * SimTokenizer.vocab_size
        rate = self.eos_rate if eos else 0.0
        logits = [_FLOOR] * SimTokenizer.vocab_size
        for byte, n in counts.items():
            weights[byte + SimTokenizer.OFFSET] = (1 - rate) * n / len(_ALPHABET)
        if rate:
            weights[SimTokenizer.EOS] = rate
        for t, w in enumerate(weights):
            if w:
                logits[t] = math.log(w)
        norm = _logsumexp(logits)
        return [x - norm for x in logits]

    def base(self, params: SamplingParams) -> list[float]:
        """Log-probabilities over the vocabulary before anything the request asks."""
        return self._base[self.eos_rate > 0 and not params.ignore_eos]

    def logprob(self, seq: _SimSeq, token: int) -> TokenLogprob:
        """A drawn token's logprob and the k most likely, as vLLM's raw logprobs: the model's
        own, before bias, penalties or a guide."""
        eos = self.eos_rate > 0 and not seq.params.ignore_eos
        base = self._base[eos]
        k = seq.params.logprobs or 0
        return TokenLogprob(token, base[token], tuple((t, base[t]) for t in self._ranked[eos][:k]))

    def prompt_logprobs(self, seq: _SimSeq, k: int) -> list[PromptLogprob]:
        """Its prompt logprobs: every prompt token's (after the first) under its one
        distribution, with its rank and the k most likely."""
        eos = self.eos_rate > 0 and not seq.params.ignore_eos
        base, ranked = self._base[eos], self._ranked[eos]
        rank = {t: i + 1 for i, t in enumerate(ranked)}
        top = tuple((t, base[t]) for t in ranked[:k])
        prompt = seq.input_ids[1 : seq.prompt_tokens]
        return [PromptLogprob(t, base[t], rank[t], top) for t in prompt]

    def draw(
        self,
        seq: _SimSeq,
        u: float,
        stops: frozenset[int],
        bad_words: Sequence[tuple[int, ...]] = (),
    ) -> int:
        """Inverse-CDF draw at `u` in [0, 1) from the distribution the request reshapes, as
        vLLM orders it: bias and min_tokens' masks, then the penalties (repetition over prompt
        and output, presence/frequency over the output), allowed tokens and bad words, then
        min_p."""
        p = seq.params
        # its logits: the log-probabilities shifted up so its own tokens' are positive, as a
        # real model's likely tokens are (only the repetition penalty, which shrinks positive
        # logits and grows negative ones, sees the difference)
        logits = [x + _LOGIT_SHIFT for x in self.base(p)]
        for t, bias in p.logit_bias:
            logits[t] += bias
        if p.ignore_eos:
            logits[SimTokenizer.EOS] = -math.inf
        if len(seq.out_ids) < p.min_tokens:
            for t in stops:
                logits[t] = -math.inf
        counts = Counter(seq.out_ids)
        if p.repetition_penalty != 1.0:
            r = p.repetition_penalty
            for t in {*seq.input_ids, *seq.out_ids}:
                logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
        for t, n in counts.items():
            logits[t] -= p.frequency_penalty * n + p.presence_penalty
        if p.allowed_token_ids:
            allowed = set(p.allowed_token_ids)
            logits = [x if t in allowed else -math.inf for t, x in enumerate(logits)]
        for t in banned_tokens(bad_words, seq.out_ids):
            logits[t] = -math.inf
        top = max(logits)
        weights = [math.exp(x - top) if x > -math.inf else 0.0 for x in logits]
        if p.min_p:  # on probabilities: the most likely token's weight is 1
            weights = [w if w >= p.min_p else 0.0 for w in weights]
        target = u * sum(weights)
        acc = 0.0
        for t, w in enumerate(weights):
            acc += w
            if w and acc > target:
                return t
        return max(range(len(weights)), key=weights.__getitem__)


def _logsumexp(xs: Sequence[float]) -> float:
    top = max(xs)
    return top + math.log(sum(math.exp(x - top) for x in xs))


def guided_text(guide: Guide, pick: int) -> str:
    """What the sim writes under a guide: one of the choices (by `pick`), or the smallest JSON
    value of the schema (`{}` for any object); InvalidRequest for a guide it cannot follow."""
    if guide.choice is not None:
        if not guide.choice:
            raise InvalidRequest("choice must not be empty", param="response_format")
        return guide.choice[pick % len(guide.choice)]
    if guide.json_object:
        return "{}"
    if guide.json is not None:
        try:
            schema = json.loads(guide.json)
        except ValueError as exc:
            raise InvalidRequest(
                f"the JSON schema is not JSON: {exc}", param="response_format"
            ) from exc
        value = _instance(schema, schema, 0)
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    what = "a regex" if guide.regex is not None else "a grammar"
    raise InvalidRequest(
        f"the sim engine cannot follow {what} guide; only choices and JSON",
        param="response_format",
        code="unsupported_parameter",
    )


def _instance(schema: Any, root: Any, depth: int) -> Any:
    """The smallest value of a JSON schema, for the schemas applications send (objects of
    required properties, scalars with bounds, enums, arrays, $ref into $defs)."""
    if depth > 32:
        raise _unsupported("recursion deeper than 32")
    if schema is True or schema == {}:
        return None
    if not isinstance(schema, dict):
        raise _unsupported(f"schema {schema!r}")
    if "$ref" in schema:
        ref = schema["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/"):
            raise _unsupported(f"$ref {ref!r}")
        target: Any = root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise _unsupported(f"$ref {ref!r}")
            target = target[part]
        return _instance(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        if not schema["enum"]:
            raise _unsupported("an empty enum")
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return _instance(schema[key][0], root, depth + 1)
    if "allOf" in schema:
        if len(schema["allOf"]) != 1:
            raise _unsupported("allOf of several schemas")
        return _instance(schema["allOf"][0], root, depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else None)
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        required = schema.get("required", [])
        props = schema.get("properties", {})
        return {name: _instance(props.get(name, {}), root, depth + 1) for name in required}
    if kind == "array":
        n = int(schema.get("minItems", 0))
        return [_instance(schema.get("items", {}), root, depth + 1) for _ in range(n)]
    if kind == "string":
        if "pattern" in schema or "format" in schema:
            raise _unsupported("a string pattern or format")
        n = int(schema.get("minLength", 0))
        return ("sim" + "s" * n)[: max(n, min(3, int(schema.get("maxLength", 3))))]
    if kind in ("integer", "number"):
        return _bounded_integer(schema)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    raise _unsupported(f"type {kind!r}")


def _bounded_integer(schema: dict[str, Any]) -> int:
    """The integer nearest 0 within a number schema's bounds."""
    lows = [math.ceil(schema["minimum"])] if "minimum" in schema else []
    if "exclusiveMinimum" in schema:
        lows.append(math.floor(schema["exclusiveMinimum"]) + 1)
    highs = [math.floor(schema["maximum"])] if "maximum" in schema else []
    if "exclusiveMaximum" in schema:
        highs.append(math.ceil(schema["exclusiveMaximum"]) - 1)
    low, high = max(lows, default=None), min(highs, default=None)
    value = low if low is not None and low > 0 else high if high is not None and high < 0 else 0
    if (low is not None and value < low) or (high is not None and value > high):
        raise _unsupported("number bounds no integer meets")
    if "multipleOf" in schema and value % schema["multipleOf"]:
        raise _unsupported("multipleOf")
    return value


def _unsupported(what: str) -> InvalidRequest:
    return InvalidRequest(
        f"the sim engine cannot write a JSON value for this schema: {what}",
        param="response_format",
        code="unsupported_parameter",
    )


class PrefixCache:
    """An LRU of prompt blocks, as vLLM's automatic prefix caching: a block is named by the hash
    of every token up to its end, so a hit is always a whole leading run of blocks. As in vLLM,
    a prompt's blocks are freed last-first, so eviction eats a prefix from its tail and what is
    left still hits."""

    def __init__(self, capacity_tokens: int, block: int = 16) -> None:
        self.block = block
        self.capacity = capacity_tokens // block  # blocks held
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Tokens of `token_ids` already cached (its leading whole blocks); then its blocks are
        cached, its first block the most recently used. A `salt` is hashed into every block's
        name, as vLLM's: only a prompt of the same salt hits them."""
        if self.capacity <= 0:
            return 0
        digest = hashlib.blake2b(digest_size=16)
        if salt is not None:
            digest.update(b"salt\0" + salt.encode())
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

    A step that starts a sequence added `alone` (`EngineRequest.alone`) steps only such
    sequences: its prefill and a decode of a batch of one, while the others wait.

    With `prefix_cache_tokens` > 0 the engine keeps an LRU prefix cache of that many tokens and a
    cached leading run of blocks costs nothing to prefill (prefix affinity's engine).

    Tokens depend only on the prompt and position (and seed when sampling), so resuming from
    prompt + generated tokens reproduces an uninterrupted run exactly.
    """

    name = "sim"
    # Its logprobs are exact, but of a made-up distribution: served only where asked for
    # (`logprobs=True`, tests of the logprobs path), so that by default a client asking a
    # sim-served model for logprobs is refused rather than given numbers that read like a
    # model's. (A class attribute: a subclass may declare its own.)
    features = frozenset(Feature) - {Feature.LOGPROBS, Feature.PROMPT_LOGPROBS}

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
        logprobs: bool = False,
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
        self.model = SimModel(eos_rate)
        self.fail_rate = fail_rate
        self.fail_marker = fail_marker
        self._rng = random.Random(seed)
        self._sleep = sleep or time.sleep
        self._prefill_cap: int | None = None
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        if logprobs:
            self.features = frozenset(Feature)

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._channel.bind(asyncio.get_running_loop())
        self._start_thread("tokenyard-sim-engine")

    def add(self, request: EngineRequest) -> None:
        tok = self.tokenizer
        prompt = request.prompt_token_ids
        digest = hashlib.blake2b(digest_size=16)
        digest.update(b"".join(t.to_bytes(4, "little") for t in prompt))
        params = request.params
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
        seq.priority = request.priority
        seq.position = len(seq.input_ids)
        seq.out_ids = list(request.resume_token_ids)
        if params.guide is not None:
            pick = int.from_bytes(seq.key[:8], "little")
            seq.plan = guided_text(params.guide, pick).encode()
        seq.bad_words = bad_words_token_ids(params.bad_words, tok.encode)
        marker = self.fail_marker
        seq.fail = bool(marker and marker in tok.decode(prompt))
        with self._cond:
            if self._hold_locked(seq):
                self._cond.notify_all()

    def cap_prefill(self, tokens: int | None) -> None:
        self._prefill_cap = tokens if tokens is None else max(1, tokens)  # read by the loop

    def _loop(self) -> None:
        while True:
            with self._cond:
                if not self._wait_locked(self._seqs):
                    return
                batch = list(self._seqs.values())
                # a step that starts an `alone` sequence runs only those: the others wait it out
                alone = [s for s in batch if s.alone and not s.prefilled]
                batch = alone or batch
                started = [s for s in batch if not s.prefilled]
                # chunks of the prompts begun or going on, within the cap (alone ones uncapped)
                chunks = self._chunks(started, None if alone else self._prefill_cap)
                batch = [s for s in batch if s.prefilled]  # those whose prompt is all in decode
            if chunks:
                self._sleep(self.prefill_base + self.prefill_per_token * sum(chunks))
            if batch:
                self._sleep(self.decode_base + self.decode_per_seq * len(batch))
                with self._cond:
                    self._step_locked(batch)

    def _chunks(self, started: list[_SimSeq], cap: int | None) -> list[int]:
        """The prompt tokens this step prefills of each of `started`, in order, at most `cap`
        in all; a sequence's cached leading blocks cost nothing (looked up as it begins)."""
        chunks: list[int] = []
        queries = hits = 0
        if cap is not None:  # what outranks goes first: a high job is not chunked behind batch
            started = sorted(started, key=lambda s: s.priority)
        for s in started:
            if s.prefill_done < 0:
                found = self.prefix_cache.lookup_and_insert(s.input_ids, s.params.cache_salt)
                queries += len(s.input_ids)
                hits += found
                if self.prefix_cache.capacity:  # a sim without one knows of no cache
                    s.cached_tokens = min(found, s.prompt_tokens)
                s.prefill_done = found
            take = len(s.input_ids) - s.prefill_done
            if cap is not None:
                take = min(take, cap - sum(chunks))
            s.prefill_done += take
            s.prefilled = s.prefill_done >= len(s.input_ids)
            chunks.append(take)
            if cap is not None and sum(chunks) >= cap:
                break
        if queries:
            with self._lock:
                self._stats.prefix_cache_queries += queries
                self._stats.prefix_cache_hits += hits
        return chunks

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
            seq.out_ids.append(token)
            delta = seq.decoder.feed([token])
            self._stats.tokens_generated += len(delta.token_ids)
            out = seq.output(delta)
            if seq.params.logprobs is not None:
                out.logprobs = [self.model.logprob(seq, t) for t in delta.token_ids]
            k = seq.params.prompt_logprobs
            if k is not None and not seq.prompt_logprobs_sent:
                out.prompt_logprobs = self.model.prompt_logprobs(seq, k)
                seq.prompt_logprobs_sent = True
            outputs.append(out)
            if delta.finish_reason is not None:
                self._release_locked(seq)
        if stepped:
            self._stats.steps += 1
            self._stats.sequences_stepped += stepped
        self._deliver(outputs)

    def _token(self, seq: _SimSeq) -> int:
        h = hashlib.blake2b(seq.key + seq.position.to_bytes(4, "little"), digest_size=16).digest()
        pick = int.from_bytes(h[:8], "little")
        if seq.plan is not None:
            return self._guided(seq)
        if seq.reshaped:
            # what min_tokens holds off, as vLLM's: EOS (unless ignored) and the stop ids
            p = seq.params
            stops = frozenset(p.stop_token_ids) | (
                frozenset() if p.ignore_eos else {SimTokenizer.EOS}
            )
            return self.model.draw(seq, pick / (_MASK64 + 1), stops, seq.bad_words)
        eos_draw = int.from_bytes(h[8:], "little") / _MASK64
        if not seq.params.ignore_eos and eos_draw < self.eos_rate:
            return SimTokenizer.EOS
        return _ALPHABET[pick % len(_ALPHABET)] + SimTokenizer.OFFSET

    def _guided(self, seq: _SimSeq) -> int:
        """The next byte of the plan; then EOS, once min_tokens allows it (until then spaces,
        which a JSON value may end with); a request ignoring EOS goes on with spaces."""
        assert seq.plan is not None
        i = len(seq.out_ids)
        if i < len(seq.plan):
            return seq.plan[i] + SimTokenizer.OFFSET
        if i < seq.params.min_tokens or seq.params.ignore_eos:
            return ord(" ") + SimTokenizer.OFFSET
        return SimTokenizer.EOS
