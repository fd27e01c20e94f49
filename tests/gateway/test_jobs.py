"""The async jobs API: submit, inspect, idempotency, cancel, deadlines."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.gateway.conftest import MODEL, Stack, run_stack, slow_engine
from tests.gateway.sse import events
from tests.gateway.test_errors import assert_error
from tokenyard.broker.redis.embedded import EmbeddedServer

BODY = {"model": MODEL, "prompt": "tell me", "max_tokens": 8, "temperature": 0.0}


def wait_done(http: httpx.Client, job_id: str, timeout: float = 10.0) -> dict[str, Any]:
    give_up = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        assert time.monotonic() < give_up, job
        time.sleep(0.05)


def test_submit_then_inspect_result_and_timings(stack: Stack) -> None:
    with stack.client() as http:
        created = http.post("/v1/jobs", json=BODY)
        assert created.status_code == 202, created.text
        job = created.json()
        assert created.headers["location"] == f"/v1/jobs/{job['id']}"
        assert job["status"] in ("queued", "running") and job["priority"] == "normal"

        done = wait_done(http, job["id"])
        assert done["status"] == "succeeded"
        result = done["result"]
        assert result["finish_reason"] == "length" and len(result["text"]) == 8
        assert result["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}
        t = done["timings"]
        assert t["enqueued_at"] <= t["started_at"] <= t["finished_at"]
        assert 0 <= t["queue_time"] <= t["e2e"] < 10

        chat = http.post(
            "/v1/jobs",
            json={"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert chat.status_code == 202
        assert wait_done(http, chat.json()["id"])["result"]["usage"]["completion_tokens"] == 3
        # the events of a finished job replay from the start
        with http.stream("GET", f"/v1/jobs/{chat.json()['id']}/events") as replay:
            kinds = [ev.event for ev in events(replay)]
        # one event per engine step, or fewer when the worker folds steps it published late
        assert kinds[-1] == "finish" and 1 <= len(kinds) - 1 <= 3
        assert set(kinds[:-1]) == {"tokens"}


def test_idempotency_key_returns_the_same_job_or_409(stack: Stack) -> None:
    with stack.client() as http:
        key = {"Idempotency-Key": "order-42"}
        first = http.post("/v1/jobs", json=BODY, headers=key)
        again = http.post("/v1/jobs", json=BODY, headers=key)
        assert first.status_code == 202 and again.status_code == 200
        assert again.headers["idempotent-replayed"] == "true"
        assert again.json()["id"] == first.json()["id"]
        assert_error(
            http.post("/v1/jobs", json={**BODY, "prompt": "other"}, headers=key),
            409,
            "idempotency_key_reused",
        )
        assert http.post("/v1/jobs", json=BODY).json()["id"] != first.json()["id"]


def test_cancel_queued_running_and_finished_jobs(valkey: EmbeddedServer) -> None:
    with (
        run_stack(
            valkey, engines=[slow_engine(0.05)], worker_options={"max_seqs": 1, "claim_ahead": 0}
        ) as stack,
        stack.client() as http,
    ):
        long = {**BODY, "max_tokens": 200}
        running = http.post("/v1/jobs", json=long).json()["id"]
        queued = http.post("/v1/jobs", json=long).json()["id"]
        give_up = time.monotonic() + 5
        while http.get(f"/v1/jobs/{running}").json()["status"] != "running":
            assert time.monotonic() < give_up
            time.sleep(0.02)

        cancelled = http.delete(f"/v1/jobs/{queued}")
        assert (cancelled.status_code, cancelled.json()["status"]) == (200, "cancelled")
        signalled = http.delete(f"/v1/jobs/cmpl-{running}")  # completion ids work too
        assert (signalled.status_code, signalled.json()["status"]) == (202, "cancelling")
        done = wait_done(http, running)
        assert done["status"] == "cancelled" and done["cancel_requested"]
        assert 0 < done["result"]["usage"]["completion_tokens"] < 200
        assert_error(http.delete(f"/v1/jobs/{running}"), 409, "job_finished")
        assert http.get(f"/v1/jobs/{queued}").json()["status"] == "cancelled"


def test_deadlines_and_stream_flag(valkey: EmbeddedServer) -> None:
    with run_stack(valkey, engines=[]) as stack, stack.client() as http:
        assert_error(http.post("/v1/jobs", json={**BODY, "stream": True}), 400)
        assert_error(http.post("/v1/jobs", json={**BODY, "deadline": 30}), 400)  # no time
        late = http.post("/v1/jobs", json={**BODY, "deadline": time.time() - 1})
        assert_error(late, 429, "deadline_unmeetable")  # passed: it cannot be met
        job = http.post("/v1/jobs", json={**BODY, "deadline": time.time() + 0.2}).json()
        assert job["deadline"] is not None and job["status"] == "queued"
        time.sleep(0.3)
        # a worker that arrives after the deadline finishes the job as expired, engine unused
        stack.start_worker()
        done = wait_done(http, job["id"])
        assert done["status"] == "expired"
        assert done["result"]["error"]["code"] == "queue_timeout"


def test_a_job_that_fails_everywhere_is_a_500_without_internals(valkey: EmbeddedServer) -> None:
    with run_stack(valkey, broker_options={"max_deliveries": 1, "backoff_base_s": 0.01}) as stack:
        with stack.client() as http:
            # the sim engine fails any prompt containing its failure marker
            failed = http.post("/v1/completions", json={**BODY, "prompt": "x [[fail]]"})
        error = assert_error(failed, 500, "job_dead")
        assert error["type"] == "server_error"
