"""Per-row sampling maths of the transformers engines: temperature, top-k/top-p, Gumbel noise.

Logits are temperature-scaled and top-k/top-p filtered per row, then Gumbel noise keyed by
(seed, absolute position) is added and the argmax is taken. That gives exact greedy decoding
(temperature 0 is a plain argmax), honours per-request seeds, and makes seeded sampling
independent of batch composition, so a resumed sequence continues exactly.

Tensor ops only, so everything is safe inside CUDA graphs; shortcuts that need a host sync are
skipped while a graph is being captured.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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


def process_rows(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """Scores whose argmax is each row's next token: greedy rows exact, sampled rows seeded."""
    out = apply_temperature(scores.float(), temperature)
    out = apply_top_k_top_p(out, top_k, top_p)
    return add_gumbel_noise(out, keys)
