"""Pure quota maths: GCRA for requests and tokens per minute, a concurrency cap, and the
OpenAI rate-limit headers. The broker's reserve/settle scripts do the same arithmetic
atomically (tokenyard/broker/lua/reserve.lua, settle.lua); tests hold the two together."""

from __future__ import annotations

import math

import msgspec

PERIOD_S = 60.0  # RPM and TPM are per minute; GCRA lets a full minute's worth in a burst


class Quota(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's limits; 0 means unlimited."""

    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens per minute: prompt + max_tokens reserved, settled to the real count
    max_concurrent: int = 0  # jobs admitted and not yet terminal

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent)


class QuotaState(msgspec.Struct, kw_only=True):
    """What the broker keeps per tenant: theoretical arrival times (unix s) and jobs held."""

    rpm_tat: float = 0.0
    tpm_tat: float = 0.0
    active: int = 0


class Gcra(msgspec.Struct, frozen=True):
    allowed: bool
    tat: float  # the new theoretical arrival time if allowed, else the old one
    retry_after_s: float  # 0 when allowed
    remaining: int  # units still admissible right now (after this one, if allowed)
    reset_s: float  # until the limiter is back to a full burst


def gcra(tat: float, now: float, cost: float, limit: int, period_s: float = PERIOD_S) -> Gcra:
    """Generic cell rate algorithm: `limit` units per `period_s`, bursts up to `limit`.

    Each unit advances the theoretical arrival time by period/limit; a request fits when the
    advanced time is no more than one period ahead of now."""
    interval = period_s / limit
    base = max(tat, now)
    advanced = base + cost * interval
    if advanced - now <= period_s + 1e-6:
        return Gcra(
            True, advanced, 0.0, _remaining(advanced, now, interval, period_s), advanced - now
        )
    retry = advanced - period_s - now
    if cost > limit:
        retry = math.inf  # never fits
    return Gcra(False, tat, retry, _remaining(base, now, interval, period_s), base - now)


def _remaining(tat: float, now: float, interval: float, period_s: float) -> int:
    return max(0, int((period_s - (tat - now)) / interval + 1e-6))


def refund(tat: float, tokens: float, limit: int, period_s: float = PERIOD_S) -> float:
    """Move a tokens limiter back by `tokens` units (a reservation settled below its size)."""
    return tat - tokens * (period_s / limit)


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """One admission: admitted or why not, and what the rate-limit headers say."""

    admitted: bool
    reason: str = ""  # requests | tokens | concurrency | too_large
    retry_after_s: float = 0.0
    requests: tuple[int, int, float] | None = None  # limit, remaining, reset_s
    tokens: tuple[int, int, float] | None = None


def admit(state: QuotaState, quota: Quota, tokens: int, now: float) -> Decision:
    """Decide one job of `tokens` reserved tokens; on admission `state` is advanced."""
    req = gcra(state.rpm_tat, now, 1, quota.rpm) if quota.rpm else None
    tok = gcra(state.tpm_tat, now, tokens, quota.tpm) if quota.tpm else None
    rh = None if req is None else (quota.rpm, req.remaining, req.reset_s)
    th = None if tok is None else (quota.tpm, tok.remaining, tok.reset_s)

    def no(reason: str, retry: float) -> Decision:
        return Decision(admitted=False, reason=reason, retry_after_s=retry, requests=rh, tokens=th)

    if quota.max_concurrent and state.active >= quota.max_concurrent:
        return no("concurrency", 1.0)
    if req is not None and not req.allowed:
        return no("requests", req.retry_after_s)
    if tok is not None and not tok.allowed:
        return no("too_large" if math.isinf(tok.retry_after_s) else "tokens", tok.retry_after_s)
    if req is not None:
        state.rpm_tat = req.tat
    if tok is not None:
        state.tpm_tat = tok.tat
    state.active += 1
    return Decision(admitted=True, requests=rh, tokens=th)


def settle(state: QuotaState, quota_tpm_interval: float, reserved: int, actual: int) -> None:
    """Release a job's concurrency slot and refund the tokens it reserved but did not use."""
    state.active = max(0, state.active - 1)
    if quota_tpm_interval > 0 and actual < reserved:
        state.tpm_tat -= (reserved - actual) * quota_tpm_interval


def duration(seconds: float) -> str:
    """OpenAI's reset format: '6m0s', '1.5s', '20ms'."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def headers(decision: Decision) -> dict[str, str]:
    """x-ratelimit-* (OpenAI's names) and, on a refusal, Retry-After in whole seconds."""
    out: dict[str, str] = {}
    for kind, values in (("requests", decision.requests), ("tokens", decision.tokens)):
        if values is None:
            continue
        limit, remaining, reset_s = values
        out[f"x-ratelimit-limit-{kind}"] = str(limit)
        out[f"x-ratelimit-remaining-{kind}"] = str(remaining)
        out[f"x-ratelimit-reset-{kind}"] = duration(reset_s)
    if not decision.admitted and not math.isinf(decision.retry_after_s):
        out["retry-after"] = str(max(1, math.ceil(decision.retry_after_s)))
    return out
