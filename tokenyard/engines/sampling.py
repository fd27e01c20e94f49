"""Per-row sampling maths of the transformers engines: temperature, top-k/top-p, Gumbel noise.

Logits are temperature-scaled and top-k/top-p filtered per row, then Gumbel noise keyed by
(seed, absolute position) is added and the argmax is taken. That gives exact greedy decoding
(temperature 0 is a plain argmax), honours per-request seeds, and makes seeded sampling
independent of batch composition, so a resumed sequence continues exactly.

Tensor ops only, so everything is safe inside CUDA graphs; shortcuts that need a host sync are
skipped while a graph is being captured. Penalties, logit_bias, min_tokens and structured-output
masks (vLLM's formulas and order) reach the logits through dense per-row buffers that the host
fills before each forward pass (`AdjustBuffers`), and logprobs leave through `LogprobBuffers`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from tokenyard.engines.badwords import banned_tokens
from tokenyard.limits import MAX_LOGPROBS
from tokenyard.messages import PromptLogprob, SamplingParams

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


def noise_key(seed: int, position: int) -> int:
    """31-bit key for the noise of one (seed, absolute position); splitmix64 finaliser."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) & 0x7FFFFFFF


def sample_keys(seeds: Sequence[int | None], positions: Sequence[int]) -> list[int]:
    """Noise keys per row; None marks a greedy row (key -1)."""
    return [-1 if s is None else noise_key(s, p) for s, p in zip(seeds, positions, strict=True)]


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def apply_temperature(scores: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Scale rows by 1/T; rows with T <= 0 (greedy) become one-hot on their argmax."""
    greedy = (temperature <= 0).unsqueeze(-1)
    onehot = torch.full_like(scores, float("-inf"))
    onehot.scatter_(-1, scores.argmax(dim=-1, keepdim=True), 0.0)
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return torch.where(greedy, onehot, scores / safe_t.unsqueeze(-1))


def apply_top_k_top_p(
    scores: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Keep each row's k best logits (k <= 0: all), then its nucleus p (p >= 1: all).

    One ascending sort serves both filters; the rules are transformers' TopK and TopP warpers
    applied in that order (ties with the k-th logit are kept).
    """
    vocab = scores.size(-1)
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    if not _capturing(scores) and bool((k >= vocab).all()) and bool((top_p >= 1).all()):
        return scores
    sorted_logits, sorted_idx = torch.sort(scores, descending=False, dim=-1)
    kth = sorted_logits.gather(-1, (vocab - k).long().unsqueeze(-1))
    below_k = sorted_logits < kth
    sorted_logits = sorted_logits.masked_fill(below_k, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - top_p).unsqueeze(-1)
    remove[..., -1:] = False
    remove |= below_k
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


def apply_min_p(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p: drop each row's tokens less likely than min_p times its most likely one
    (on the temperature-scaled distribution; min_p <= 0: none)."""
    if not _capturing(scores) and bool((min_p <= 0).all()):
        return scores
    probs = scores.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.clamp_min(0).unsqueeze(-1)
    return scores.masked_fill(probs < threshold, float("-inf"))


def process_rows(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scores whose argmax is each row's next token: greedy rows exact, sampled rows seeded.
    vLLM's order: temperature, min_p, then top-k and top-p."""
    out = apply_temperature(scores.float(), temperature)
    if min_p is not None:
        out = apply_min_p(out, min_p)
    out = apply_top_k_top_p(out, top_k, top_p)
    return add_gumbel_noise(out, keys)


# --------------------------------------------------------------------------------------------
# Penalties, logit bias, masks and logprobs (vLLM's formulas), per row
# --------------------------------------------------------------------------------------------


def apply_logit_bias(scores: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """OpenAI's logit_bias: a dense [rows, vocab] bias added to the logits."""
    return scores + bias


def apply_repetition_penalty(
    scores: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor
) -> torch.Tensor:
    """CTRL's repetition penalty over the tokens `seen` (prompt and output, a bool mask): a
    positive logit is divided by the row's penalty, any other multiplied by it."""
    p = penalty.unsqueeze(-1)
    penalised = torch.where(scores > 0, scores / p, scores * p)
    return torch.where(seen, penalised, scores)


def apply_frequency_presence(
    scores: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor
) -> torch.Tensor:
    """OpenAI's penalties over the output's token `counts`: minus frequency x count, minus
    presence once a token occurred."""
    return (
        scores
        - frequency.unsqueeze(-1) * counts
        - presence.unsqueeze(-1) * (counts > 0).to(scores.dtype)
    )


def apply_adjustments(
    scores: torch.Tensor, pre: torch.Tensor, factor: torch.Tensor, post: torch.Tensor
) -> torch.Tensor:
    """All of the above in vLLM's order from three dense buffers: `pre` (logit_bias) is added,
    then the repetition `factor` (1: no penalty) applied, then `post` added (frequency and
    presence penalties, -inf for tokens masked by min_tokens or a structured output)."""
    s = scores + pre
    s = torch.where(s > 0, s / factor, s * factor)
    return s + post


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed int32 bitmask ([rows, ceil(vocab / 32)], bit j of word i is token
    32 i + j) as a bool [rows, vocab] mask of allowed tokens."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.size(0), -1)[:, :vocab].bool()


class RowFeatures:
    """One sequence's decoding state beyond temperature/top-k/top-p/min-p: what its
    penalties, bias and masks need (the output so far), its structured-output matcher, its
    allowed tokens and bad words (as token sequences: `bad_words_token_ids`), its logprobs."""

    def __init__(
        self,
        params: SamplingParams,
        *,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int] = (),
        stop_ids: Collection[int] = (),
        matcher: Matcher | None = None,
        bad_words: Sequence[tuple[int, ...]] = (),
    ) -> None:
        self.params = params
        self.allowed = params.allowed_token_ids
        self.bad_words = list(bad_words)
        self._allowed_masks: dict[tuple[int, torch.device], torch.Tensor] = {}
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.bias = params.logit_bias
        self.min_tokens = params.min_tokens
        self.logprobs = params.logprobs
        self.matcher = matcher
        # Host tensors built once, so a step's fill costs per row a few tensor ops, not a
        # Python loop over the prompt: the bias pairs, what min_tokens holds back (the
        # end-of-sequence ids and the stop token ids), the prompt's distinct tokens.
        self.bias_ids = torch.tensor([t for t, _ in self.bias], dtype=torch.int64)
        self.bias_values = torch.tensor([b for _, b in self.bias], dtype=torch.float32)
        self.stop_ids = torch.tensor(sorted({*stop_ids, *params.stop_token_ids}), dtype=torch.int64)
        prompt = prompt_ids if self.repetition != 1.0 else ()
        self.prompt_ids = torch.tensor(sorted(set(prompt)), dtype=torch.int64)
        self.output: list[int] = []
        self.counts: dict[int, int] = {}  # output token -> occurrences
        self.push(output_ids)

    @property
    def adjusts(self) -> bool:
        """Whether its logits change before sampling (some row buffer is not neutral)."""
        return bool(
            self.presence
            or self.frequency
            or self.repetition != 1.0
            or self.bias
            or self.matcher is not None
            or len(self.output) < self.min_tokens
            or self.allowed
            or self.bad_words
        )

    def allowed_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """Its allowed tokens as a bool [vocab] mask on `device` (made once)."""
        mask = self._allowed_masks.get((vocab, device))
        if mask is None:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[torch.tensor([t for t in self.allowed if t < vocab], dtype=torch.int64)] = True
            mask = self._allowed_masks[(vocab, device)] = mask.to(device)
        return mask

    def push(self, token_ids: Sequence[int]) -> None:
        """Count generated tokens (resumed ones too)."""
        self.output.extend(token_ids)
        for tok in token_ids:
            self.counts[tok] = self.counts.get(tok, 0) + 1


class Matcher(Protocol):
    """The structured-output matcher a row follows (`tokenyard.engines.guide.GuideMatcher`)."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None: ...

    def accept(self, token_id: int) -> bool: ...

    @property
    def terminated(self) -> bool: ...


class AdjustBuffers:
    """Dense per-row buffers for `apply_adjustments`, kept neutral (0, 1, 0) outside the rows
    of the current step that use them, so they can live at fixed addresses (CUDA graphs)."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.pre = torch.zeros(rows, vocab, device=device)
        self.factor = torch.ones(rows, vocab, device=device)
        self.post = torch.zeros(rows, vocab, device=device)
        self._dirty: list[int] = []
        self._bitmask: torch.Tensor | None = None

    @property
    def dirty(self) -> bool:
        """Whether some row is not neutral (the last fill wrote rows)."""
        return bool(self._dirty)

    def fill(self, rows: Sequence[tuple[int, RowFeatures]]) -> None:
        """Reset last step's rows, then write this step's (row index, features)."""
        device = self.pre.device
        if self._dirty:
            dirty = torch.tensor(self._dirty, device=device)
            self.pre.index_fill_(0, dirty, 0.0)
            self.factor.index_fill_(0, dirty, 1.0)
            self.post.index_fill_(0, dirty, 0.0)
        self._dirty = [r for r, _ in rows]
        pre: list[_Entries] = []
        factor: list[_Entries] = []
        post: list[_Entries] = []
        guided: list[tuple[int, Matcher]] = []
        allowed: list[tuple[int, RowFeatures]] = []
        for r, f in rows:
            if f.bias:
                pre.append(_entries(r, f.bias_ids, f.bias_values))
            if f.repetition != 1.0 or f.frequency or f.presence:
                out_ids = torch.tensor(list(f.counts), dtype=torch.int64)
                if f.repetition != 1.0:
                    ids = torch.cat([f.prompt_ids, out_ids])  # a repeat writes the same value
                    factor.append(_entries(r, ids, torch.full(ids.shape, f.repetition)))
                if f.frequency or f.presence:
                    n = torch.tensor(list(f.counts.values()), dtype=torch.float32)
                    post.append(_entries(r, out_ids, -(f.frequency * n + f.presence)))
            if len(f.output) < f.min_tokens:
                post.append(_entries(r, f.stop_ids, torch.full(f.stop_ids.shape, -math.inf)))
            if f.bad_words and (banned := banned_tokens(f.bad_words, f.output)):
                ids = torch.tensor(sorted(banned), dtype=torch.int64)
                post.append(_entries(r, ids, torch.full(ids.shape, -math.inf)))
            if f.allowed:
                allowed.append((r, f))
            if f.matcher is not None:
                guided.append((r, f.matcher))
        for buf, entries, accumulate in (
            (self.pre, pre, False),
            (self.factor, factor, False),
            # a held-back token may also be penalised: -inf + x stays -inf
            (self.post, post, True),
        ):
            if entries:
                where = tuple(torch.cat([e[i] for e in entries]).to(device) for i in (0, 1))
                values = torch.cat([e[2] for e in entries]).to(device, buf.dtype)
                buf.index_put_(where, values, accumulate=accumulate)
        for r, f in allowed:
            keep = f.allowed_mask(self.vocab, self.post.device)
            self.post[r] = self.post[r].masked_fill(~keep, float("-inf"))
        if guided:
            self._mask_guided(guided)

    def _mask_guided(self, guided: list[tuple[int, Matcher]]) -> None:
        words = (self.vocab + 31) // 32
        if self._bitmask is None or self._bitmask.size(0) < len(guided):
            self._bitmask = torch.empty(self.pre.size(0), words, dtype=torch.int32)
        bitmask = self._bitmask
        for i, (_, matcher) in enumerate(guided):
            matcher.fill(bitmask, i)
        device = self.post.device
        rows = torch.tensor([r for r, _ in guided], device=device)
        allowed = unpack_bitmask(bitmask[: len(guided)].to(device), self.vocab)
        self.post[rows] = self.post[rows].masked_fill(~allowed, float("-inf"))

    def apply(self, scores: torch.Tensor) -> torch.Tensor:
        n = scores.size(0)
        return apply_adjustments(scores, self.pre[:n], self.factor[:n], self.post[:n])


# (rows, token ids, values) to write into a buffer
_Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _entries(row: int, ids: torch.Tensor, values: torch.Tensor) -> _Entries:
    return torch.full_like(ids, row), ids, values


class LogprobBuffers:
    """Each row's chosen token, its raw logprob and the `MAX_LOGPROBS` most likely (id, logprob),
    written on the device where sampling runs and read by the host after the step."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.k = min(MAX_LOGPROBS, vocab)  # the most a request may ask for
        self.chosen = torch.zeros(rows, dtype=torch.int64, device=device)
        self.chosen_logprob = torch.zeros(rows, device=device)
        self.top_ids = torch.zeros(rows, self.k, dtype=torch.int64, device=device)
        self.top_logprobs = torch.zeros(rows, self.k, device=device)

    def record(self, raw: torch.Tensor, processed: torch.Tensor) -> None:
        """From the model's raw logits and the scores whose argmax is the next token."""
        # log_softmax(x) = x - logsumexp(x), and topk commutes with the shift: only the k + 1
        # values read are shifted, no rows x vocab log-probabilities are written
        n = raw.size(0)
        raw = raw.float()
        norm = raw.logsumexp(dim=-1, keepdim=True)
        chosen = processed.argmax(dim=-1)
        self.chosen[:n].copy_(chosen)
        self.chosen_logprob[:n].copy_((raw.gather(-1, chosen.unsqueeze(-1)) - norm).squeeze(-1))
        top = raw.topk(self.k, dim=-1)
        self.top_ids[:n].copy_(top.indices)
        self.top_logprobs[:n].copy_(top.values - norm)

    def read(self, n: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """The first n rows on the host: (chosen id, its logprob, top (id, logprob) pairs)."""
        chosen = self.chosen[:n].tolist()
        lp = self.chosen_logprob[:n].tolist()
        ids = self.top_ids[:n].tolist()
        vals = self.top_logprobs[:n].tolist()
        return [
            (c, v, list(zip(i, t, strict=True)))
            for c, v, i, t in zip(chosen, lp, ids, vals, strict=True)
        ]


# prompt positions log-softmaxed at once: bounds the [rows, vocab] temporaries
_PROMPT_ROWS = 256


def prompt_logprobs(logits: torch.Tensor, tokens: Sequence[int], k: int) -> list[PromptLogprob]:
    """vLLM's prompt logprobs from the raw logits that predicted each of `tokens` (row i
    predicted tokens[i]): its logprob, its rank (1 + the tokens more likely) and the k most
    likely."""
    out: list[PromptLogprob] = []
    ids = torch.tensor(list(tokens), dtype=torch.int64, device=logits.device)
    for start in range(0, len(tokens), _PROMPT_ROWS):
        rows = logits[start : start + _PROMPT_ROWS].float().log_softmax(dim=-1)
        chosen = ids[start : start + _PROMPT_ROWS]
        values = rows.gather(-1, chosen.unsqueeze(-1))
        ranks = (rows > values).sum(dim=-1) + 1
        top = rows.topk(k, dim=-1) if k else None
        for i, (token, value, rank) in enumerate(
            zip(chosen.tolist(), values.squeeze(-1).tolist(), ranks.tolist(), strict=True)
        ):
            pairs: tuple[tuple[int, float], ...] = ()
            if top is not None:
                pairs = tuple(zip(top.indices[i].tolist(), top.values[i].tolist(), strict=True))
            out.append(PromptLogprob(int(token), float(value), int(rank), pairs))
    return out
