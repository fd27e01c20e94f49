"""A sync or streaming caller that goes away cancels its job and frees the engine slot."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack, slow_engine
from tests.gateway.sse import events
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.messages import JobStatus


def wait_status(stack: Stack, job_id: str, want: JobStatus, timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    while True:
        record = stack.call(stack.gateway_broker.queue.record(job_id))
        if record is not None and record.status is want:
            return
        assert time.monotonic() < give_up, f"job {job_id} is {record and record.status}"
        time.sleep(0.05)


@pytest.fixture
def one_slot(valkey: EmbeddedServer) -> Stack:
    # one worker with a single slot, 20 tokens/s: a 200-token job would hold it for 10 s
    with run_stack(valkey, engines=[slow_engine(0.05)], worker_options={"max_seqs": 1}) as s:
        yield s  # type: ignore[misc]


def test_dropped_sync_request_cancels_its_job_and_frees_the_slot(one_slot: Stack) -> None:
    stack = one_slot
    long_body = {"model": MODEL, "prompt": "long one", "max_tokens": 200, "temperature": 0.0}
    with stack.client(timeout=0.6) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json=long_body)
    [job_id] = stack.job_ids()
    wait_status(stack, job_id, JobStatus.CANCELLED, timeout=5.0)
    record = stack.call(stack.gateway_broker.queue.record(job_id))
    assert record.result is not None and record.result.completion_tokens < 200

    started = time.monotonic()
    with stack.client() as http:
        short = http.post("/v1/completions", json={**long_body, "prompt": "short", "max_tokens": 5})
    assert short.status_code == 200, short.text
    assert short.json()["choices"][0]["finish_reason"] == "length"
    assert time.monotonic() - started < 5.0  # the slot was reused, not held for 10 s


def test_dropped_stream_cancels_its_job(one_slot: Stack) -> None:
    stack = one_slot
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 200, "stream": True}
    with stack.client() as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            job_id = response.headers["x-job-id"]
            for ev in events(response):
                assert ev.json()["choices"][0]["text"]
                break
        wait_status(stack, job_id, JobStatus.CANCELLED, timeout=5.0)
        job = http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "cancelled"
        assert job["result"]["finish_reason"] == "cancelled"


def test_sync_request_past_the_request_timeout_is_504_and_its_job_cancelled(
    valkey: EmbeddedServer,
) -> None:
    with run_stack(valkey, engines=[slow_engine(0.05)], request_timeout_s=0.5) as stack:
        body = {"model": MODEL, "prompt": "too long", "max_tokens": 200, "temperature": 0.0}
        with stack.client() as http:
            started = time.monotonic()
            response = http.post("/v1/completions", json=body)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"
        assert time.monotonic() - started < 5.0
        [job_id] = stack.job_ids()
        wait_status(stack, job_id, JobStatus.CANCELLED, timeout=5.0)
