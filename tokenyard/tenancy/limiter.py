"""Pure quota maths: GCRA for requests and tokens per minute, a concurrency cap, and the
OpenAI rate-limit headers. The broker's reserve/settle scripts do the same arithmetic
atomically (tokenyard/broker/redis/lua/reserve.lua, settle.lua); tests hold the two together."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import msgspec

PERIOD_S = 60.0  # RPM and TPM are per minute; GCRA lets a full minute's worth in a burst
DAY_S = 86400.0


class Quota(msgspec.Struct, frozen=True, kw_only=True):
    """A tenant's limits; 0 means unlimited."""

    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens per minute: prompt + max_tokens reserved, settled to the real count
    max_concurrent: int = 0  # jobs admitted and not yet terminal
    # tokens per budget period (prompt + max_tokens reserved, settled to the real count)
    token_budget: int = 0
    budget_period: str = "day"  # day | month (UTC calendar) | seconds (epoch-aligned windows)

    @property
    def enabled(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_concurrent or self.token_budget)


def check_period(period: str) -> str:
    """A valid `budget_period` as given; ValueError otherwise."""
    if period in ("day", "month"):
        return period
    try:
        seconds = float(period)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or math.isinf(seconds):
        raise ValueError(f"budget period must be day, month or seconds > 0, not {period!r}")
    return period


def period_window(now: float, period: str) -> tuple[float, float]:
    """The budget period holding `now`: (start, end) in unix seconds. Days and months are UTC
    calendar ones; a number of seconds makes windows aligned to the epoch."""
    if period == "month":
        moment = datetime.fromtimestamp(now, UTC)
        first = datetime(moment.year, moment.month, 1, tzinfo=UTC)
        year, month = (
            (moment.year + 1, 1) if moment.month == 12 else (moment.year, moment.month + 1)
        )
        return first.timestamp(), datetime(year, month, 1, tzinfo=UTC).timestamp()
    length = DAY_S if period == "day" else float(period)
    start = math.floor(now / length) * length
    return start, start + length


class QuotaState(msgspec.Struct, kw_only=True):
    """What the broker keeps per tenant: theoretical arrival times (unix s) and jobs held."""

    rpm_tat: float = 0.0
    tpm_tat: float = 0.0
    active: int = 0
    budget_start: float = 0.0  # the budget period `budget_used` counts in
    budget_used: int = 0


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
    reason: str = ""  # requests | tokens | concurrency | too_large | budget
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
        # a refusal takes nothing: what remains is what remained before it
        rn = None if not quota.rpm else _before(state.rpm_tat, quota.rpm)
        tn = None if not quota.tpm else _before(state.tpm_tat, quota.tpm)
        return Decision(admitted=False, reason=reason, retry_after_s=retry, requests=rn, tokens=tn)

    def _before(tat: float, limit: int) -> tuple[int, int, float]:
        base = max(tat, now)
        return limit, _remaining(base, now, PERIOD_S / limit, PERIOD_S), base - now

    if quota.max_concurrent and state.active >= quota.max_concurrent:
        return no("concurrency", 1.0)
    if req is not None and not req.allowed:
        return no("requests", req.retry_after_s)
    if tok is not None and not tok.allowed:
        return no("too_large" if math.isinf(tok.retry_after_s) else "tokens", tok.retry_after_s)
    if quota.token_budget:
        start, end = period_window(now, quota.budget_period)
        used = state.budget_used if state.budget_start == start else 0
        if used + tokens > quota.token_budget:
            # nothing but the period's reset makes room (a budget larger than the job's need)
            if tokens > quota.token_budget:
                return no("too_large", math.inf)
            return no("budget", end - now)
        state.budget_start, state.budget_used = start, used + tokens
    if req is not None:
        state.rpm_tat = req.tat
    if tok is not None:
        state.tpm_tat = tok.tat
    state.active += 1
    return Decision(admitted=True, requests=rh, tokens=th)


def settle(
    state: QuotaState,
    quota_tpm_interval: float,
    reserved: int,
    actual: int,
    budget_start: float | None = None,
    request_interval: float = 0.0,
) -> None:
    """Release a job's concurrency slot and refund the tokens it reserved but did not use (to
    the budget too, if the job was reserved against it in the period still counting), and
    with a `request_interval` (a job never entered) its request."""
    state.active = max(0, state.active - 1)
    state.rpm_tat -= request_interval
    if quota_tpm_interval > 0 and actual < reserved:
        state.tpm_tat -= (reserved - actual) * quota_tpm_interval
    if budget_start is not None and budget_start == state.budget_start and actual < reserved:
        state.budget_used = max(0, state.budget_used - (reserved - actual))


def budget_left(state: QuotaState | None, quota: Quota, now: float) -> int | None:
    """Tokens the tenant may still reserve in the budget period holding `now` (reservations
    count until settled); None without a budget."""
    if not quota.token_budget:
        return None
    start, _ = period_window(now, quota.budget_period)
    used = state.budget_used if state is not None and state.budget_start == start else 0
    return max(0, quota.token_budget - used)


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
