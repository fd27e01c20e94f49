"""In-flight collapsing over real HTTP on every queue core: identical concurrent requests cost one
engine job, also those arriving as the job ends, before its answer is in the response cache
(issue 36: the job's end and its cached answer are two writes)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.base import EngineRequest
from tokenyard.engines.sim import SimEngine

CALLERS = 40


class CountingSim(SimEngine):
    """The sim engine, remembering the prompt of every sequence it was given: the engine jobs."""

    def __init__(self, step_s: float) -> None:
        super().__init__(
            prefill_base=0.001, prefill_per_token=0.0, decode_base=step_s, decode_per_seq=0.0
        )
        self.started: list[str] = []
        self._counting = threading.Lock()

    def add(self, request: EngineRequest) -> None:
        with self._counting:
            self.started.append(self.tokenizer.decode(request.prompt_token_ids))
        super().add(request)

    def jobs(self, marker: str) -> int:
        with self._counting:
            return sum(marker in prompt for prompt in self.started)


@pytest.fixture(
    params=[
        ("valkey", True),
        ("valkey", False),
        ("nats", True),
        ("nats", False),
        pytest.param(("rabbitmq", True), marks=pytest.mark.rabbitmq),
        pytest.param(("rabbitmq", False), marks=pytest.mark.rabbitmq),
    ],
    ids=lambda p: f"{p[0]}-{'cache' if p[1] else 'nocache'}",
)
def served(
    request: pytest.FixtureRequest, valkey: EmbeddedServer
) -> Iterator[tuple[Stack, CountingSim]]:
    """A gateway and one counting sim worker on the param's queue core; with the response cache
    on, or off (collapsing alone: every late arrival meets the window the cache would close)."""
    kind, cache = request.param
    url, options = None, {}
    if kind == "nats":
        url = request.getfixturevalue("nats_server").url
    elif kind == "rabbitmq":
        url = request.getfixturevalue("rabbitmq").url
        options = {"tables_url": valkey.url}
    engine = CountingSim(step_s=0.02)
    with run_stack(
        valkey, engines=[lambda: engine], broker_url=url, broker_options=options, cache=cache
    ) as stack:
        give_up = time.monotonic() + 20
        while not stack.call(stack.gateway_broker.registry.workers(MODEL)):
            assert time.monotonic() < give_up, "the worker never sent a heartbeat"
            time.sleep(0.05)
        yield stack, engine


async def _round(
    http: httpx.AsyncClient, stack: Stack, marker: str, max_tokens: int, gaps: list[float]
) -> list[httpx.Response]:
    """CALLERS identical greedy requests, the i-th sent `gaps[i]` s after the one before."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": f"collapse {marker}",
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }

    async def call() -> httpx.Response:
        return await http.post(stack.url + "/v1/completions", json=body)

    calls = []
    for gap in gaps:
        if gap:
            await asyncio.sleep(gap)
        calls.append(asyncio.create_task(call()))
    return await asyncio.gather(*calls)


async def test_identical_concurrent_requests_cost_one_engine_job(
    served: tuple[Stack, CountingSim],
) -> None:
    stack, engine = served
    async with httpx.AsyncClient(timeout=60) as http:
        # the gateway learns the workers' revision (nothing is collapsed before it knows it)
        give_up = time.monotonic() + 20
        while True:
            [warm] = await _round(http, stack, f"warm {time.monotonic()}", 1, [0])
            assert warm.status_code == 200, warm.text
            if warm.headers.get("x-cache") == "miss":
                break
            assert time.monotonic() < give_up, "the gateway never took part in collapsing"
            await asyncio.sleep(0.2)
        rounds = {
            # all at once; a 2-token job ends while the burst is still being admitted
            "burst": (2, [0.0] * CALLERS),
            # one every 10 ms over 0.4 s; the 10-token job (~0.2 s) ends among them
            "staggered": (10, [0.0] + [0.01] * (CALLERS - 1)),
            # a burst, then the rest in the ~0.1 s around the 5-token job's end
            "waves": (5, [0.0] * 10 + [0.08] + [0.005] * 29),
        }
        for name, (max_tokens, gaps) in rounds.items():
            answers = await _round(http, stack, name, max_tokens, gaps)
            assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
            assert len({json.dumps(r.json()["choices"]) for r in answers}) == 1
            verdicts = [r.headers["x-cache"] for r in answers]
            assert engine.jobs(name) == 1, (name, verdicts)
            assert verdicts.count("miss") == 1, (name, verdicts)
            assert set(verdicts) <= {"miss", "collapsed", "hit"}
