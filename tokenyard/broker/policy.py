"""Pure delivery policy every backend shares: retry backoff, the order lanes are claimed in,
size pools, fair-share cost, which worker a job with a known prefix is held for, which job an
identical request joins (collapsing), and when a worker counts as dead."""

from __future__ import annotations

import bisect
import random
from collections.abc import Mapping, Sequence

from tokenyard.messages import JobSpec, JobStatus

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


def estimated_tokens(spec: JobSpec) -> int:
    """Prompt + max_tokens: what a job may hold of an engine's context (text: ~4 bytes/token)."""
    if spec.prompt_token_ids is not None:
        prompt = len(spec.prompt_token_ids)
    else:
        prompt = len((spec.prompt or "").encode()) // 4 + 1
    return prompt + spec.sampling.max_tokens


def size_pool(tokens: int, bounds: Sequence[int]) -> int:
    """The size pool of a job of `tokens`: pool p holds bounds[p-1] < tokens <= bounds[p], and
    the last pool everything above the last bound (no bounds: one pool, 0)."""
    return bisect.bisect_left(bounds, tokens)


def stamp_by_model(
    specs: Sequence[JobSpec], now: float, bounds: Sequence[int]
) -> dict[str, list[int]]:
    """Stamp each new job (its arrival, unless given, and its size pool) and group the batch's
    indexes by model: every backend enqueues a model's jobs together."""
    by_model: dict[str, list[int]] = {}
    for index, spec in enumerate(specs):
        if not spec.created_at:
            spec.created_at = now
        spec.pool = size_pool(estimated_tokens(spec), bounds)
        by_model.setdefault(spec.model, []).append(index)
    return by_model


def pools_served(context: int, bounds: Sequence[int]) -> list[int]:
    """The pools a worker whose longest sequence is `context` claims from, in order: the largest
    pool whose every job it can hold, then each smaller one (an idle pool takes smaller work).
    The last pool is open-ended: a worker serves it when its context exceeds the last bound."""
    if bounds and context > bounds[-1]:
        own = len(bounds)
    else:
        own = max((p for p, bound in enumerate(bounds) if bound <= context), default=0)
    return list(range(own, -1, -1))


def fair_cost(spec: JobSpec) -> int:
    """What a job counts against its tenant's share of a lane: the tokens it may use."""
    return len(spec.prompt_token_ids or ()) + spec.sampling.max_tokens


# start-time fair queueing inside a lane: each tenant with waiting jobs has a start tag; the
# smallest tag (then the name) goes next and advances by the job's cost over its weight; a
# tenant that becomes active starts at the lane's virtual time (the last tag served), so idling
# earns no credit. Redis runs the same rule in lua/lib/fair.lua.


def active_tag(idle_tag: float, virtual: float) -> float:
    """The start tag of a tenant whose jobs start waiting again."""
    return max(idle_tag, virtual)


def next_turn(tags: Mapping[str, float]) -> str:
    """Whose job goes next among the active tenants' tags."""
    return min(tags, key=lambda name: (tags[name], name))


def advanced(tag: float, cost: float, weight: float) -> float:
    """A tenant's tag after one of its jobs of `cost` went."""
    return tag + cost / max(weight, 1e-9)


def staging_score(spec: JobSpec) -> float:
    """Order of a tenant's own waiting jobs: earliest deadline first, then arrival."""
    return spec.deadline if spec.deadline is not None else _NO_DEADLINE + spec.created_at


# prefix affinity: a job whose prompt prefix a worker claimed last is held for that worker
# (whose engine likely still caches the prefix) for a bounded time; the gateway computes the key


def hold_for(owner: str | None, held: int, max_held: int) -> bool:
    """Whether a new job is held for the prefix's `owner`: it has one, and fewer than
    `max_held` jobs already wait for it (a hot prefix must not pile up on one worker)."""
    return bool(owner) and held < max_held


def overdue(held_at: float, now: float, wait_s: float) -> bool:
    """A held job any worker may take: it waited `wait_s` for its preferred worker."""
    return now - held_at >= wait_s


def joinable(status: JobStatus, ended_at: float | None, now: float, grace_s: float) -> bool:
    """Whether an identical request joins the job its collapse key names: while it is queued
    or running, and for `grace_s` after it succeeded, so one arriving between the job's end and
    its answer reaching the response cache reads the answer from the record instead of running
    it again. The bound ends that window where no gateway cached the answer (it died first, or
    the cache is off). Redis and RabbitMQ lanes apply the same rule in lua/lib/admit.lua."""
    if not status.terminal:
        return True
    return status is JobStatus.SUCCEEDED and ended_at is not None and now - ended_at < grace_s


# worker liveness (`BrokerSettings.liveness_s`): a worker's beat says it lives until a moment;
# once that passed, any worker's reap takes its jobs over, long before their leases run out
LIVENESS_BEATS = 4  # beats per liveness_s: a pause of up to 3/4 of it passes


def beat_period(liveness_s: float) -> float:
    """How often a worker beats, and reaps: a killed worker's jobs move within
    liveness_s + this (plus one claim) of its death."""
    return liveness_s / LIVENESS_BEATS


def lapsed(live: Mapping[str, float], now: float) -> list[str]:
    """The workers of `live` (each mapped to when its last beat lapses) dead by `now`."""
    return sorted(worker for worker, until in live.items() if until <= now)


def beating_since(since: float | None, covered_until: float | None, landed: float) -> float:
    """Since when a worker's liveness has had no gap, after a beat went through at `landed`:
    one that landed after the previous beat's liveness ran out (held back by an outage, it
    did not fail) leaves a gap in which others may have reaped, and starts the count again."""
    if since is None or covered_until is None or landed > covered_until:
        return landed
    return since


def may_reap(beating_since: float | None, now: float, liveness_s: float) -> bool:
    """Whether a worker may reap (take over other workers' jobs): its own beats have gone
    through for a full liveness_s. One that was just cut off from the broker, as the others
    likely were too, first waits for them to beat again (None: its last beat failed)."""
    return beating_since is not None and now - beating_since >= liveness_s
