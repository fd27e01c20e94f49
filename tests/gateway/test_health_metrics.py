"""/healthz, /readyz and /metrics."""

from __future__ import annotations

import re
import time

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{labels}")


def test_ready_once_a_worker_is_live(valkey: EmbeddedServer) -> None:
    with run_stack(valkey, engines=[]) as stack, stack.client() as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        not_ready = http.get("/readyz")
        assert not_ready.status_code == 503
        assert "no live worker" in not_ready.json()["error"]["message"]
        stack.start_worker()
        give_up = time.monotonic() + 5
        while (ready := http.get("/readyz")).status_code != 200:  # its first heartbeat
            assert time.monotonic() < give_up, ready.text
            time.sleep(0.05)
        assert ready.json()["workers"] == {MODEL: 1}


def test_metrics_count_requests_and_time_tokens(stack: Stack) -> None:
    with stack.client() as http:
        body = {"model": MODEL, "prompt": "measure me", "max_tokens": 6}
        assert http.post("/v1/completions", json=body).status_code == 200
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            r.read()
        assert http.post("/v1/completions", json={**body, "model": "nope"}).status_code == 404
        http.get("/v1/jobs/whatever")
        text = http.get("/metrics").text

    ok = sample(text, "tokenyard_http_requests_total", route="/v1/completions", status="200")
    assert ok == 2
    assert sample(text, "tokenyard_http_requests_total", route="/v1/completions", status="404") == 1
    # job ids never become label values
    assert (
        sample(text, "tokenyard_http_requests_total", route="/v1/jobs/{job_id}", status="404") == 1
    )
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert sample(text, f"tokenyard_{name}_seconds_count", model=MODEL) == 2
    # the sync call's worker times its 5 gaps; the stream's gaps are seen as events arrive, and
    # tokens that share the first event with the first token have no gap of their own
    assert 5 <= sample(text, "tokenyard_inter_token_latency_seconds_count", model=MODEL) <= 10
    assert sample(text, "tokenyard_generation_tokens_total", model=MODEL) == 12
    assert sample(text, "tokenyard_queue_depth", model=MODEL, priority="normal") == 0
    assert sample(text, "tokenyard_live_workers", model=MODEL) == 1
    assert sample(text, "tokenyard_broker_up") == 1

    def buckets(name: str) -> list[float]:
        pattern = rf'{name}_bucket{{le="([^"]+)",model="{MODEL}"}}'
        return [float(b) for b in re.findall(pattern, text) if b != "+Inf"]

    assert buckets("tokenyard_time_to_first_token_seconds") == list(TTFT_BUCKETS)
    assert buckets("tokenyard_inter_token_latency_seconds") == list(ITL_BUCKETS)
    assert buckets("tokenyard_e2e_request_latency_seconds") == list(REQUEST_LATENCY_BUCKETS)
    assert buckets("tokenyard_request_queue_time_seconds") == list(REQUEST_LATENCY_BUCKETS)
