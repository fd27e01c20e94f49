"""The gateway's hot path on a real Valkey: group commit of enqueues, one multiplexed read,
and the limits workers publish."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import redis

from tests.gateway.conftest import MODEL, run_stack, slow_engine
from tests.gateway.sse import events
from tokenyard.broker import connect, new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings
from tokenyard.engines.sim import SimTokenizer
from tokenyard.gateway.events import EventHub
from tokenyard.messages import (
    Finished,
    FinishReason,
    JobResult,
    JobSpec,
    JobStatus,
    ModelLimits,
    TokenChunk,
    WorkerInfo,
)

BODY = {"model": MODEL, "prompt": "tell me", "max_tokens": 4, "temperature": 0.0}


def command_calls(valkey: EmbeddedServer, command: str) -> int:
    stats: dict[str, Any] = redis.Redis.from_url(valkey.url).info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def post_all(url: str, bodies: list[dict[str, Any]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
        return list(await asyncio.gather(*(http.post("/v1/jobs", json=b) for b in bodies)))


def test_concurrent_requests_share_enqueue_calls(valkey: EmbeddedServer) -> None:
    with run_stack(valkey, engines=[]) as stack:  # no worker: every EVALSHA is an enqueue
        before = command_calls(valkey, "evalsha")
        answers = asyncio.run(post_all(stack.url, [BODY] * 48))
        calls = command_calls(valkey, "evalsha") - before
        assert [a.status_code for a in answers] == [202] * 48
        assert len({a.json()["id"] for a in answers}) == 48 == len(stack.job_ids())
        assert calls <= 24, f"48 concurrent requests took {calls} enqueue calls"


def test_a_full_lane_refuses_only_its_own_jobs(valkey: EmbeddedServer) -> None:
    with run_stack(valkey, engines=[], broker_options={"max_queue_depth": 4}) as stack:
        normal, low = dict(BODY), {**BODY, "priority": "low"}
        answers = asyncio.run(post_all(stack.url, [normal] * 8 + [low] * 4))
        codes = [a.status_code for a in answers]
        # the normal lane takes four; every low job fits its own lane, though they came
        # in the same batches as the refused ones
        assert sorted(codes[:8]) == [202] * 4 + [429] * 4, codes
        assert codes[8:] == [202] * 4, codes
        refused = next(a for a in answers if a.status_code == 429)
        assert refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["retry-after"] == "1"


def test_many_streams_share_few_blocking_reads(valkey: EmbeddedServer) -> None:
    followers = 24
    # the server is shared: earlier tests' blocked reads may linger until their timeout
    before = max(int(c["id"]) for c in redis.Redis.from_url(valkey.url).client_list())
    with run_stack(
        valkey,
        engines=[slow_engine(0.1)],
        max_blocking_reads=2,
        worker_options={"max_seqs": followers},
    ) as stack:
        blocked: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            # the gateway's reads plus at most the worker's blocking claim
            client = redis.Redis.from_url(valkey.url)
            while not stop.is_set():
                clients: list[dict[str, Any]] = client.client_list()
                ours = [c for c in clients if int(c["id"]) > before]
                # blocked now ('b' flag), not merely last used for an XREAD: a pooled
                # connection keeps its last command after its read returned
                blocked.append(
                    sum(1 for c in ours if c.get("cmd") == "xread" and "b" in c.get("flags", ""))
                )
                time.sleep(0.02)

        def stream(i: int) -> list[str]:
            body = {
                **BODY,
                "prompt": f"story {i}",
                "max_tokens": 6,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            with stack.client() as http, http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                return [ev.data for ev in events(r)]

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            results: list[list[str]] = [[] for _ in range(followers)]

            def run(i: int) -> None:
                results[i] = stream(i)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(followers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            stop.set()
            watcher.join()
        for frames in results:
            assert frames[-1] == "[DONE]"
            # one step's events may be merged under load; the usage chunk counts every token
            assert json.loads(frames[-2])["usage"]["completion_tokens"] == 6
        assert max(blocked) <= 2 + 1, blocked


async def test_hub_serves_many_followers_with_few_reads(valkey: EmbeddedServer) -> None:
    broker = connect(BrokerSettings(url=valkey.url, prefix=f"hub{time.time_ns()}"))
    try:
        specs = [JobSpec(id=new_job_id(MODEL), model=MODEL, prompt="x") for _ in range(40)]
        await broker.queue.enqueue_many(specs)
        leases = await broker.queue.claim(MODEL, "w", slots=len(specs))
        hub = EventHub(broker.queue, block_s=2.0, max_reads=2)
        follows = [hub.follow(s.id, MODEL) for s in specs]

        async def drain(index: int) -> list[str]:
            seen: list[str] = []
            while True:
                for _, event in await follows[index].next(5.0):
                    if isinstance(event, Finished):
                        return seen
                    seen.append(event.text)

        readers = [asyncio.create_task(drain(i)) for i in range(len(follows))]
        for step in range(3):
            await asyncio.sleep(0.02)
            await broker.queue.append_events(
                [(lease, TokenChunk(token_ids=[step], text=str(step))) for lease in leases]
            )
        done = JobResult(status=JobStatus.SUCCEEDED, finish_reason=FinishReason.LENGTH)
        await broker.queue.complete_many([(lease, done) for lease in leases])
        got = await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert got == [["0", "1", "2"]] * len(specs)
        # one read per wake-up for all 40 jobs, not one per job per event
        assert hub.reads <= 20, hub.reads
        await hub.close()
    finally:
        await broker.close()


def test_requests_are_checked_against_the_limits_workers_publish(valkey: EmbeddedServer) -> None:
    with run_stack(valkey, engines=[]) as stack:
        broker = stack.gateway_broker
        for name, context in (("small", 64), ("large", 128)):
            info = WorkerInfo(
                consumer=name,
                model=MODEL,
                engine="sim",
                host="h",
                pid=1,
                started_at=time.time(),
                limits=ModelLimits(max_model_len=context, max_seqs=4, token_budget=context),
            )
            stack.call(broker.registry.heartbeat(info, ttl_s=30))
        with stack.client() as http:
            # the loosest worker decides: 100 tokens fit the large one
            fits = http.post("/v1/jobs", json={**BODY, "prompt": "x" * 92, "max_tokens": 8})
            assert fits.status_code == 202, fits.text
            too_long = http.post("/v1/jobs", json={**BODY, "prompt": "x" * 121, "max_tokens": 8})
        assert too_long.status_code == 400
        error = too_long.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert error["message"].startswith("This model's maximum context length is 128 tokens.")
        record = stack.call(broker.queue.record(fits.json()["id"]))
        # the gateway tokenized the prompt once; the job carries the ids
        assert record.spec.prompt_token_ids == SimTokenizer().encode("x" * 92)
