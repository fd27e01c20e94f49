"""Pure delivery policy: retry backoff and the order lanes are claimed in."""

from __future__ import annotations

import random

from tokenyard.messages import JobSpec

# staged jobs without a deadline come after every job with one, in arrival order
_NO_DEADLINE = 1e10


def backoff_delay(
    attempt: int, base_s: float, max_s: float, rng: random.Random | None = None
) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(max, base * 2**attempt)].

    Full jitter spreads a burst of failures out, so retries do not arrive in lockstep.
    """
    ceiling = min(max_s, base_s * (2 ** max(attempt, 0)))
    return (rng or random).uniform(0.0, ceiling)


def claim_order(n_lanes: int, claim_round: int, starvation_every: int) -> list[int]:
    """Lane indexes (0 = highest priority) in the order one claim round reads them.

    Strict priority, except every `starvation_every`-th round puts a lower lane first, cycling
    through the lower lanes, so each still gets a share under sustained high-priority load.
    """
    order = list(range(n_lanes))
    if n_lanes < 2 or starvation_every <= 0 or (claim_round + 1) % starvation_every != 0:
        return order
    turn = (claim_round + 1) // starvation_every
    head = 1 + (turn - 1) % (n_lanes - 1)
    order.remove(head)
    return [head, *order]


def fair_cost(spec: JobSpec) -> int:
    """What a job counts against its tenant's share of a lane: the tokens it may use."""
    return len(spec.prompt_token_ids or ()) + spec.sampling.max_tokens


def staging_score(spec: JobSpec) -> float:
    """Order of a tenant's own waiting jobs: earliest deadline first, then arrival."""
    return spec.deadline if spec.deadline is not None else _NO_DEADLINE + spec.created_at
