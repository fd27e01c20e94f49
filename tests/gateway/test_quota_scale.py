"""The issue's quota tests at their named sizes: two gateway *processes* on one Valkey, 300
concurrent requests split across both, one tenant limited to 100 requests/minute, 100 requests'
worth of tokens per minute, or 100 concurrent jobs → 100 admitted, the rest 429 + Retry-After.

RPM and TPM are GCRA limiters: they refill one request's worth every 0.6 s, so a burst that
takes s seconds may admit ⌊s / 0.6⌋ more than 100 (and must admit at least 100). Concurrency
does not refill until a job ends, so there the count is exact.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest
from typer.testing import CliRunner

from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.cli import app
from tokenyard.fleet.launch import Launcher, Processes, free_port, wait_ready

REQUESTS = 300
LIMIT = 100
MAX_TOKENS = 2
RUNNER = CliRunner()


@dataclass
class Fleet:
    valkey: EmbeddedServer
    launcher: Launcher
    urls: list[str] = field(default_factory=list)
    keys: dict[str, str] = field(default_factory=dict)

    def cli(self, *args: str) -> str:
        result = RUNNER.invoke(app, [*args, *self.launcher.broker_args])
        assert result.exit_code == 0, result.output
        return result.output

    def start_worker(self, model: str) -> None:
        self.launcher.worker(
            "--engine", "sim", "--model", model, "--max-seqs", "128", "--log-level", "WARNING"
        )


@pytest.fixture(scope="module")
def fleet(valkey: EmbeddedServer) -> Iterator[Fleet]:
    procs = Processes()
    fleet = Fleet(valkey, Launcher(procs, valkey.url, f"q{uuid.uuid4().hex[:8]}"))
    # tenants and keys first, so both gateways see them from their first request
    fleet.cli("tenants", "set", "rpm", "--rpm", str(LIMIT))
    fleet.cli("tenants", "set", "conc", "--max-concurrent", str(LIMIT))
    fleet.cli("tenants", "set", "free")
    for tenant in ("rpm", "conc", "free"):
        fleet.keys[tenant] = fleet.cli("keys", "create", "--tenant", tenant).split()[-1]
    env = {**os.environ, "TOKENYARD_GATEWAY_AUTH_CACHE_S": "0.5"}
    try:
        for _ in range(2):
            port = free_port()
            fleet.launcher.gateway(port, "--engine", "sim", "--model", "tiny,quiet", env=env)
            fleet.urls.append(f"http://127.0.0.1:{port}")
        fleet.start_worker("tiny")
        for url in fleet.urls:
            wait_ready(f"{url}/healthz", procs, timeout_s=90)
        # and the worker of `tiny` is up: a free tenant's call is answered
        probe = openai.OpenAI(base_url=fleet.urls[0] + "/v1", api_key=fleet.keys["free"])
        assert probe.completions.create(model="tiny", prompt="up", max_tokens=1).choices
        yield fleet
    finally:
        procs.stop(timeout_s=30, sig=signal.SIGKILL)


@dataclass
class Burst:
    statuses: list[int]
    headers: list[httpx.Headers]
    span_s: float

    @property
    def admitted(self) -> int:
        return self.statuses.count(200)


async def burst(fleet: Fleet, key: str, model: str, n: int = REQUESTS) -> Burst:
    """`n` concurrent completions, alternating between the two gateways (the official client)."""
    clients = [
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        for url in fleet.urls
    ]

    async def one(i: int) -> tuple[int, httpx.Headers]:
        try:
            raw = await clients[i % 2].completions.with_raw_response.create(
                model=model, prompt=f"q{i % 10}", max_tokens=MAX_TOKENS
            )
            return raw.status_code, raw.headers
        except openai.APIStatusError as exc:
            assert exc.status_code == 429, exc.message
            body = exc.body if isinstance(exc.body, dict) else {}
            assert body.get("code") == "rate_limit_exceeded", exc.body
            return exc.status_code, exc.response.headers

    started = time.monotonic()
    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    refused_by: list[float] = []

    async def gather() -> list[tuple[int, httpx.Headers]]:
        out: list[tuple[int, httpx.Headers]] = []
        for task in asyncio.as_completed(tasks):
            status, headers = await task
            if status == 429:
                refused_by.append(time.monotonic())
            out.append((status, headers))
        return out

    answers = await gather()
    for client in clients:
        await client.close()
    # the burst's span: from the first request to the last refusal (admitted ones then wait
    # for their worker, which does not matter to the limiter)
    span = (max(refused_by) if refused_by else time.monotonic()) - started
    return Burst([s for s, _ in answers], [h for _, h in answers], span)


def gcra_bound(result: Burst) -> int:
    """Most admissions a 100/minute GCRA allows over the burst: the burst plus its refills."""
    return LIMIT + math.floor(result.span_s / (60.0 / LIMIT))


def test_rpm_exact_across_two_gateway_processes(fleet: Fleet) -> None:
    result = asyncio.run(burst(fleet, fleet.keys["rpm"], "tiny"))
    print(f"rpm: admitted {result.admitted} of {REQUESTS} in {result.span_s:.2f}s")
    assert LIMIT <= result.admitted <= gcra_bound(result)
    assert result.statuses.count(429) == REQUESTS - result.admitted
    assert set(result.statuses) <= {200, 429}
    for status, headers in zip(result.statuses, result.headers, strict=True):
        assert headers["x-ratelimit-limit-requests"] == str(LIMIT)
        if status == 429:
            assert int(headers["retry-after"]) == 1  # one interval: 0.6 s, in whole seconds


def test_tpm_exact_across_two_gateway_processes(fleet: Fleet) -> None:
    # one request's cost as the gateway reserves it: its prompt tokens + max_tokens
    probe = openai.OpenAI(base_url=fleet.urls[0] + "/v1", api_key=fleet.keys["free"])
    usage = probe.completions.create(model="tiny", prompt="q0", max_tokens=MAX_TOKENS).usage
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    cost = usage.prompt_tokens + MAX_TOKENS
    tpm = LIMIT * cost
    fleet.cli("tenants", "set", "tpm", "--tpm", str(tpm))
    key = fleet.cli("keys", "create", "--tenant", "tpm").split()[-1]
    result = asyncio.run(burst(fleet, key, "tiny"))
    print(f"tpm: admitted {result.admitted} of {REQUESTS} in {result.span_s:.2f}s")
    # the sim engine generates exactly max_tokens: settling refunds nothing mid-burst
    assert LIMIT <= result.admitted <= gcra_bound(result)
    for status, headers in zip(result.statuses, result.headers, strict=True):
        assert headers["x-ratelimit-limit-tokens"] == str(tpm)
        if status == 429:
            assert 1 <= int(headers["retry-after"]) <= 2


def test_concurrency_exact_across_two_gateway_processes(fleet: Fleet) -> None:
    # no worker serves `quiet` until every refusal is back: admitted jobs hold their slots
    result = asyncio.run(concurrency_burst(fleet))
    print(f"concurrency: admitted {result.admitted} of {REQUESTS}")
    assert result.admitted == LIMIT and result.statuses.count(429) == REQUESTS - LIMIT
    for status, headers in zip(result.statuses, result.headers, strict=True):
        if status == 429:
            assert int(headers["retry-after"]) == 1
    # every slot came back with its job's completion: the next 100 are admitted again
    again = asyncio.run(burst(fleet, fleet.keys["conc"], "quiet", n=LIMIT))
    assert again.admitted == LIMIT


async def concurrency_burst(fleet: Fleet) -> Burst:
    """The burst against `quiet`; its worker starts once every refusal is back, so the admitted
    jobs hold their slots until then."""
    clients = [
        openai.AsyncOpenAI(base_url=url + "/v1", api_key=fleet.keys["conc"], max_retries=0,
                           timeout=120)
        for url in fleet.urls
    ]  # fmt: skip
    refusals = 0
    all_refused = asyncio.Event()

    async def one(i: int) -> tuple[int, httpx.Headers]:
        nonlocal refusals
        try:
            raw = await clients[i % 2].completions.with_raw_response.create(
                model="quiet", prompt=f"c{i % 10}", max_tokens=MAX_TOKENS
            )
            return raw.status_code, raw.headers
        except openai.APIStatusError as exc:
            assert exc.status_code == 429, exc.message
            refusals += 1
            if refusals == REQUESTS - LIMIT:
                all_refused.set()
            return exc.status_code, exc.response.headers

    started = time.monotonic()
    tasks = [asyncio.create_task(one(i)) for i in range(REQUESTS)]
    await asyncio.wait_for(all_refused.wait(), 60)
    span = time.monotonic() - started
    await asyncio.sleep(0.2)
    assert sum(1 for t in tasks if t.done()) == REQUESTS - LIMIT  # the rest still wait
    fleet.start_worker("quiet")
    answers = await asyncio.gather(*tasks)
    for client in clients:
        await client.close()
    return Burst([s for s, _ in answers], [h for _, h in answers], span)


def test_token_budget_across_two_gateway_processes(fleet: Fleet) -> None:
    # 10 requests' worth of tokens per day: the 11th is refused until the day's reset (UTC)
    probe = openai.OpenAI(base_url=fleet.urls[0] + "/v1", api_key=fleet.keys["free"])
    usage = probe.completions.create(model="tiny", prompt="q0", max_tokens=MAX_TOKENS).usage
    assert usage is not None
    budget = 10 * (usage.prompt_tokens + MAX_TOKENS)
    fleet.cli("tenants", "set", "budget", "--token-budget", str(budget), "--budget-period", "day",
              "--rpm", "1000")  # fmt: skip
    key = fleet.cli("keys", "create", "--tenant", "budget").split()[-1]
    result = asyncio.run(burst(fleet, key, "tiny", n=30))
    assert result.admitted == 10  # no refill within a period: exact
    now = time.time()
    to_reset = 86400 - now % 86400
    for status, headers in zip(result.statuses, result.headers, strict=True):
        assert headers["x-ratelimit-limit-requests"] == "1000"
        if status == 429:
            assert abs(int(headers["retry-after"]) - to_reset) <= 5
    client = openai.OpenAI(base_url=fleet.urls[1] + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(model="tiny", prompt="q0", max_tokens=MAX_TOKENS)
    assert "Token budget" in refused.value.message
