"""vLLM's metric names beside tokenyard's: scraped from a running gateway (and a worker's own
registry) and checked by name, each equal to the tokenyard family it is read from."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from tests.gateway.conftest import MODEL, Stack
from tests.gateway.test_health_metrics import sample
from tokenyard.messages import EngineStats
from tokenyard.metrics import TTFT_BUCKETS, WorkerMetrics
from tokenyard.metrics.vllm import ALIASES


def test_the_gateway_shows_vllms_names_of_its_own_observations(stack: Stack) -> None:
    with stack.client() as http:
        body = {"model": MODEL, "prompt": "measure me", "max_tokens": 6}
        assert http.post("/v1/completions", json=body).status_code == 200
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            r.read()
        text = http.get("/metrics").text
    for ours, theirs in (
        ("tokenyard_time_to_first_token_seconds_count", "vllm:time_to_first_token_seconds_count"),
        ("tokenyard_e2e_request_latency_seconds_sum", "vllm:e2e_request_latency_seconds_sum"),
        ("tokenyard_request_queue_time_seconds_count", "vllm:request_queue_time_seconds_count"),
        ("tokenyard_inter_token_latency_seconds_count", "vllm:inter_token_latency_seconds_count"),
        ("tokenyard_inter_token_latency_seconds_count", "vllm:time_per_output_token_seconds_count"),
        ("tokenyard_prompt_tokens_total", "vllm:prompt_tokens_total"),
        ("tokenyard_generation_tokens_total", "vllm:generation_tokens_total"),
    ):
        assert sample(text, theirs, model_name=MODEL) == sample(text, ours, model=MODEL), theirs
    assert sample(text, "vllm:generation_tokens_total", model_name=MODEL) == 12
    assert sample(text, "vllm:request_success_total", model_name=MODEL) == 2
    # vLLM's bucket boundaries, bucket for bucket
    for le in TTFT_BUCKETS[:5]:
        ours = sample(text, "tokenyard_time_to_first_token_seconds_bucket", le=str(le))
        assert sample(text, "vllm:time_to_first_token_seconds_bucket", le=str(le)) == ours
    # a KEDA trigger's gauges: the lanes sampled at this scrape, summed over priorities
    assert sample(text, "vllm:num_requests_waiting", model_name=MODEL) == 0
    assert sample(text, "vllm:num_requests_running", model_name=MODEL) == 0
    # each family once, typed as vLLM's (a counter's named by its total, as vLLM's are)
    for alias in ALIASES:
        name = alias.name + ("_total" if alias.kind == "counter" else "")
        assert text.count(f"# TYPE {name} {alias.kind}\n") == 1, alias.name
    assert not re.search(r"^vllm:\S*_created", text, re.M)


def test_a_workers_own_registry_names_its_engine_gauges_as_vllm() -> None:
    metrics = WorkerMetrics("m")
    metrics.sample(3, 2, 10.0, EngineStats(kv_cache_usage=0.25), None)
    metrics.engine_delivered(
        EngineStats(
            steps=2,
            sequences_stepped=4,
            tokens_generated=9,
            prefill_tokens=40,
            prefix_cache_queries=40,
            prefix_cache_hits=16,
        ),
        0.1,
    )
    text = generate_latest(metrics.registry).decode()
    assert sample(text, "vllm:num_requests_running", model_name="m") == 3
    assert sample(text, "vllm:num_requests_waiting", model_name="m") == 2
    assert sample(text, "vllm:kv_cache_usage_perc", model_name="m") == 0.25
    assert sample(text, "vllm:gpu_cache_usage_perc", model_name="m") == 0.25
    assert sample(text, "vllm:prompt_tokens_total", model_name="m") == 40
    assert sample(text, "vllm:generation_tokens_total", model_name="m") == 9
    assert sample(text, "vllm:prefix_cache_queries_total", model_name="m") == 40
    assert sample(text, "vllm:prefix_cache_hits_total", model_name="m") == 16
    # a second scrape shows the same (the alias reads, it does not count)
    assert generate_latest(metrics.registry).decode() == text
