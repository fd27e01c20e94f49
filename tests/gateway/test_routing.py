"""Routing rules over HTTP: aliases, the fast path for short prompts, and its fallback."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.gateway.conftest import run_stack, slow_engine
from tokenyard.broker import new_job_id
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.messages import JobSpec, SamplingParams


def test_short_prompts_go_to_the_small_model_until_it_is_congested(
    valkey: EmbeddedServer, tmp_path: Path
) -> None:
    rules = tmp_path / "routing.json"
    rules.write_text(
        json.dumps(
            {
                "aliases": {"gpt-mini": "big"},
                "fast_path": {"model": "small", "below_tokens": 20, "max_depth": 2},
            }
        )
    )
    with (
        run_stack(valkey, model="big", models=("big", "small"), routing_file=str(rules)) as big,
        run_stack(
            valkey,
            model="small",
            prefix=big.prefix,
            engines=[slow_engine(0.05)],
            worker_options={"max_seqs": 1},
        ),
        big.client() as http,
    ):

        def served_by(model: str, prompt: str) -> str:
            body = {"model": model, "prompt": prompt, "max_tokens": 2}
            response = http.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            chosen: str = response.json()["model"]
            return chosen

        assert served_by("big", "short") == "small"
        assert served_by("gpt-mini", "short") == "small"  # an alias, then the fast path
        assert served_by("big", "a prompt of twenty or more tokens") == "big"
        assert served_by("gpt-mini", "a prompt of twenty or more tokens") == "big"
        assert served_by("small", "a prompt of twenty or more tokens") == "small"

        # congest the small model: one slot, long jobs waiting behind it
        backlog = [
            JobSpec(
                id=new_job_id("small"),
                model="small",
                prompt_token_ids=[5, 6, 7],
                sampling=SamplingParams(max_tokens=400),
            )
            for _ in range(4)
        ]
        big.call(big.gateway_broker.queue.enqueue_many(backlog))
        time.sleep(0.3)  # past the depth reading's TTL
        assert served_by("big", "short") == "big"
        for spec in backlog:
            big.call(big.gateway_broker.queue.cancel(spec.id))

        metrics = http.get("/metrics").text
        assert (
            'tokenyard_routed_requests_total{model="small",requested="big",rule="fast"} 1.0'
            in metrics
        )
        assert 'model="big",requested="big",rule="congested"} 1.0' in metrics
        assert 'model="big",requested="gpt-mini",rule="alias"} 1.0' in metrics
