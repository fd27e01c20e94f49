"""Admission against the tenant's quota (the broker decides atomically, fleet-wide) and the
OpenAI rate-limit headers the answer carries."""

from __future__ import annotations

from tokenyard.gateway.auth import Tenant
from tokenyard.gateway.errors import RateLimited
from tokenyard.gateway.state import GatewayState
from tokenyard.messages import JobSpec
from tokenyard.tenancy import limiter

_MESSAGES = {
    "requests": "Rate limit reached for requests per minute",
    "tokens": "Rate limit reached for tokens per minute",
    "concurrency": "Too many concurrent jobs for this tenant",
    "too_large": "Request too large: it needs more tokens than the tokens-per-minute limit "
    "or the token budget allows",
    "budget": "Token budget for this period exhausted (Retry-After: seconds to its reset)",
}


def reserved_tokens(spec: JobSpec) -> int:
    """What a job may use at most: its prompt plus `max_tokens`."""
    return len(spec.prompt_token_ids or ()) + spec.sampling.max_tokens


async def reserve(state: GatewayState, tenant: Tenant, spec: JobSpec) -> dict[str, str]:
    """Reserve the job's share of the tenant's quota; the rate-limit headers to answer with.
    Refused: 429 with Retry-After. A reserved job is marked so its terminal state settles it;
    where no job of its own was added, the enqueuer refunds it (gateway/enqueue.py)."""
    if not tenant.quota.enabled:
        return {}
    [decision] = await state.backend.quotas.reserve(
        tenant.name, tenant.quota, [(spec.id, reserved_tokens(spec))]
    )
    headers = limiter.headers(decision)
    if not decision.admitted:
        state.metrics.rejections.labels(f"quota_{decision.reason}").inc()
        raise RateLimited(
            f"{_MESSAGES.get(decision.reason, 'Rate limit reached')} for tenant {tenant.name}",
            code="rate_limit_exceeded",
            headers=headers,
        )
    spec.quota = True
    return headers
