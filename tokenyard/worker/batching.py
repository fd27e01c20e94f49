"""Admission policy as pure functions: how much work a worker can take on right now."""

from __future__ import annotations

from tokenyard.messages import SamplingParams


def job_footprint(prompt_tokens: int, params: SamplingParams) -> int:
    """Tokens a sequence may hold at its longest: its prompt plus everything it may generate."""
    return prompt_tokens + max(params.max_tokens, 0)


def claimable(
    max_seqs: int,
    token_budget: int,
    running_seqs: int,
    tokens_in_use: int,
    expected_footprint: int,
) -> int:
    """How many jobs to claim: free sequence slots, bounded by the tokens left in the budget.

    We claim before we know prompt lengths, so the budget is divided by the footprint seen so
    far; at least one job is claimed when the worker is idle, so a huge job cannot wedge it.
    """
    free_seqs = max(0, max_seqs - running_seqs)
    if free_seqs == 0:
        return 0
    free_tokens = max(0, token_budget - tokens_in_use)
    by_tokens = free_tokens // max(1, expected_footprint)
    if running_seqs == 0:
        by_tokens = max(1, by_tokens)
    return min(free_seqs, by_tokens)


def fits(token_budget: int, tokens_in_use: int, footprint: int, running_seqs: int) -> bool:
    """Whether a claimed job may start now; an idle engine always takes one."""
    return running_seqs == 0 or tokens_in_use + footprint <= token_budget


def moving_average(previous: float, sample: float, weight: float = 0.2) -> float:
    """Exponential moving average; the first sample seeds it."""
    return sample if previous <= 0 else previous + weight * (sample - previous)
