"""Response cache and in-flight collapsing over two gateways of one deployment (one Valkey)."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack, slow_engine
from tests.gateway.sse import events
from tests.gateway.test_disconnect import wait_status
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.cached import CACHE_HEADER
from tokenyard.messages import JobStatus

STEP_S = 0.05  # the sim worker's decode step: a 30-token job runs 1.5 s


@pytest.fixture(scope="module")
def gateways(valkey: EmbeddedServer) -> Iterator[tuple[Stack, Stack]]:
    """Two gateways sharing one deployment's keys; the one worker runs behind the first."""
    with (
        run_stack(valkey, engines=[slow_engine(STEP_S)]) as a,
        run_stack(valkey, engines=[], prefix=a.prefix) as b,
    ):
        give_up = time.monotonic() + 10
        while not a.call(a.gateway_broker.registry.workers(MODEL)):
            assert time.monotonic() < give_up, "the worker never sent a heartbeat"
            time.sleep(0.05)
        yield a, b


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _answer(body: dict[str, Any]) -> tuple[Any, Any]:
    return body["choices"], body["usage"]


async def test_identical_concurrent_requests_over_two_gateways_run_one_job(
    gateways: tuple[Stack, Stack],
) -> None:
    a, b = gateways
    body = {"model": MODEL, "prompt": "collapse me", "max_tokens": 30, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=60) as http:

        async def call(i: int, payload: dict[str, Any]) -> tuple[httpx.Response, float]:
            started = time.perf_counter()
            url = (a if i % 2 else b).url + "/v1/completions"
            response = await http.post(url, json=payload)
            return response, time.perf_counter() - started

        # a gateway keys the cache (and collapses) only once it has read the model's revision
        # from what the worker published: under load that can take a moment
        for i, gateway in enumerate((a, b)):
            give_up = time.monotonic() + 15
            while True:
                warm = {**body, "prompt": f"warm {i}", "max_tokens": 1}
                answer = await http.post(gateway.url + "/v1/completions", json=warm)
                if CACHE_HEADER.lower() in answer.headers:
                    break
                assert time.monotonic() < give_up, "the gateway never learnt the revision"
                await asyncio.sleep(0.1)
        before = len(a.job_ids())

        first = await asyncio.gather(*(call(i, body) for i in range(100)))
        assert all(r.status_code == 200 for r, _ in first), first[0][0].text
        assert len(a.job_ids()) == before + 1  # one engine job for 100 requests
        answers = {json.dumps(_answer(r.json())) for r, _ in first}
        assert len(answers) == 1
        assert r_usage(first[0][0])["completion_tokens"] == 30
        verdicts = [r.headers["x-cache"] for r, _ in first]
        assert verdicts.count("miss") == 1
        assert set(verdicts) <= {"miss", "collapsed", "hit"}

        # a repeat after completion is a cache hit, from either gateway
        hits = [await call(i, body) for i in range(20)]
        assert {r.headers["x-cache"] for r, _ in hits} == {"hit"}
        assert {json.dumps(_answer(r.json())) for r, _ in hits} == answers
        assert len(a.job_ids()) == before + 1

        # misses of the same shape, for the comparison (short jobs: 2 tokens, 0.1 s)
        misses = [
            await call(i, {**body, "prompt": f"miss {i}", "max_tokens": 2}) for i in range(10)
        ]
        assert {r.headers["x-cache"] for r, _ in misses} == {"miss"}
    hit_s = [t for _, t in hits]
    miss_s = [t for _, t in misses]
    figures = {
        "hit_p50_ms": round(1000 * statistics.median(hit_s), 2),
        "hit_p99_ms": round(1000 * _pct(hit_s, 0.99), 2),
        "miss_p50_ms": round(1000 * statistics.median(miss_s), 2),
        "miss_p99_ms": round(1000 * _pct(miss_s, 0.99), 2),
        "collapsed_p50_ms": round(1000 * statistics.median(t for _, t in first), 2),
    }
    print(json.dumps(figures))
    # a hit skips the queue and the engine: well under one 2-token job
    assert statistics.median(hit_s) < statistics.median(miss_s)


def r_usage(response: httpx.Response) -> dict[str, int]:
    usage: dict[str, int] = response.json()["usage"]
    return usage


def _stream(stack: Stack, body: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
    """(X-Cache, text, chunks) of one streamed call."""
    with stack.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [ev.json() for ev in events(r) if ev.data != "[DONE]"]
        verdict = r.headers["x-cache"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    return verdict, text, chunks


def test_a_stream_hit_is_replayed_like_the_fresh_run(gateways: tuple[Stack, Stack]) -> None:
    a, b = gateways
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "replay me"}],
        "max_tokens": 6,
        "temperature": 0.9,
        "seed": 11,  # seeded sampling is deterministic too
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    fresh = _stream(a, body)
    again = _stream(b, body)
    assert (fresh[0], again[0]) == ("miss", "hit")
    assert again[1] == fresh[1] and fresh[1]
    for chunks in (fresh[2], again[2]):
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"] == {
            "prompt_tokens": fresh[2][-1]["usage"]["prompt_tokens"],
            "completion_tokens": 6,
            "total_tokens": fresh[2][-1]["usage"]["total_tokens"],
        }
    # the same request without streaming is answered from the same entry
    with b.client() as http:
        sync = http.post(
            "/v1/chat/completions", json={**body, "stream": False, "stream_options": None}
        )
    assert sync.headers["x-cache"] == "hit"
    assert sync.json()["choices"][0]["message"]["content"] == fresh[1]


def test_a_changed_parameter_or_an_opt_out_is_not_served_from_the_cache(
    gateways: tuple[Stack, Stack],
) -> None:
    a, _ = gateways
    body = {"model": MODEL, "prompt": "vary me", "max_tokens": 2, "temperature": 0.0}
    with a.client() as http:

        def verdict(payload: dict[str, Any], **headers: str) -> str | None:
            response = http.post("/v1/completions", json=payload, headers=headers)
            assert response.status_code == 200, response.text
            return response.headers.get("x-cache")

        assert verdict(body) == "miss"
        assert verdict(body) == "hit"
        assert verdict({**body, "max_tokens": 3}) == "miss"
        assert verdict({**body, "stop": ["x"]}) == "miss"
        assert verdict({**body, "seed": 5}) == "miss"
        assert verdict({**body, "cache": False}) is None
        assert verdict(body, **{"Cache-Control": "no-cache"}) is None
        assert verdict({**body, "temperature": 0.7}) is None  # not deterministic
        assert verdict(body) == "hit"


def test_a_collapsed_job_is_cancelled_only_when_its_last_follower_leaves(
    gateways: tuple[Stack, Stack],
) -> None:
    a, b = gateways
    body = {"model": MODEL, "prompt": "follow me", "max_tokens": 40, "temperature": 0.0}
    stream = {**body, "stream": True}
    with a.client() as one, b.client() as two:
        with one.stream("POST", "/v1/completions", json=stream) as first:
            job_id = first.headers["x-job-id"]
            reading = events(first)  # held: a dropped iterator closes the connection
            next(reading)
            with two.stream("POST", "/v1/completions", json=stream) as second:
                assert second.headers["x-cache"] == "collapsed"
                assert second.headers["x-job-id"] == job_id
                reading.close()  # the first caller leaves; the second still follows
                chunks = [ev.json() for ev in events(second) if ev.data != "[DONE]"]
                assert all("choices" in c for c in chunks), chunks[-1]
                texts = [c["choices"][0]["text"] for c in chunks]
        record = a.call(a.gateway_broker.queue.record(job_id))
        assert record.status is JobStatus.SUCCEEDED
        assert record.result.completion_tokens == 40
        assert "".join(texts) == record.result.text

        # both followers leave: the job is cancelled
        other = {**stream, "prompt": "leave me"}
        with one.stream("POST", "/v1/completions", json=other) as first:
            job_id = first.headers["x-job-id"]
            reading = events(first)
            next(reading)
            with two.stream("POST", "/v1/completions", json=other) as second:
                assert second.headers["x-cache"] == "collapsed"
                next(events(second))  # and leaves
                time.sleep(0.3)
                record = a.call(a.gateway_broker.queue.record(job_id))
                assert record.status is JobStatus.RUNNING  # the first caller still follows
            reading.close()
        wait_status(a, job_id, JobStatus.CANCELLED, timeout=5.0)
