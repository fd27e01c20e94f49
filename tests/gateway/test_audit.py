"""The audit trail end to end: jobs through real HTTP (completed, dead, cancelled), then
`tokenyard audit` in a subprocess writes their receipts and terminal states as JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import openai
import pytest

from tests.gateway.conftest import MODEL, fast_engine, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.base import Engine
from tokenyard.engines.sim import SimEngine


def broken_engine() -> Engine:
    return SimEngine(prefill_base=0.001, decode_base=0.002, fail_rate=1.0)


def export(valkey: EmbeddedServer, prefix: str, *filters: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "tokenyard", "audit", "--broker", valkey.url, "--prefix", prefix,
         *filters],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_audit_export_of_completed_dead_and_cancelled_jobs(valkey: EmbeddedServer) -> None:
    options = {"max_deliveries": 1, "backoff_base_s": 0.01}
    with (
        run_stack(
            valkey, engines=[fast_engine], models=(MODEL, "idle", "broken"),
            broker_options=options,
        ) as one,
        run_stack(
            valkey, prefix=one.prefix, engines=[broken_engine], model="broken",
            broker_options=options,
        ),
        one.client() as http,
    ):  # fmt: skip
        client = openai.OpenAI(base_url=one.url + "/v1", api_key="none", max_retries=0)
        client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model="broken", prompt="hi", max_tokens=3)
        queued = http.post("/v1/jobs", json={"model": "idle", "prompt": "x", "max_tokens": 2})
        assert queued.status_code in (200, 201, 202), queued.text
        gone = queued.json()["id"]
        assert http.delete(f"/v1/jobs/{gone}").status_code == 200
        time.sleep(0.2)

        lines = export(valkey, one.prefix, "--since", "10m")
        assert {line["tenant"] for line in lines} == {"default"}
        by_model: dict[object, list[dict[str, object]]] = {}
        for line in lines:
            by_model.setdefault(line["model"], []).append(line)
        for model, status in ((MODEL, "succeeded"), ("broken", "dead"), ("idle", "cancelled")):
            events = [(e["event"], e["status"]) for e in by_model[model]]
            assert events == [("received", "queued"), ("terminal", status)], (model, events)
            receipt, end = by_model[model]
            assert receipt["job_id"] == end["job_id"]
            assert end["received_at"] == receipt["received_at"]
            assert isinstance(end["total_s"], float) and end["total_s"] >= 0
        done = by_model[MODEL][1]
        assert done["completion_tokens"] == 3 and done["prompt_tokens"] == 2
        assert done["max_tokens"] == 3 and done["finish_reason"] == "length"
        assert by_model["idle"][1]["job_id"] == gone

        # the filters: tenant, model, and a time past every entry
        assert export(valkey, one.prefix, "--since", "1h", "--tenant", "nobody") == []
        only = export(valkey, one.prefix, "--since", "1h", "--model", "idle")
        assert [e["status"] for e in only] == ["queued", "cancelled"]
        future = str(time.time() + 3600)
        assert export(valkey, one.prefix, "--since", future) == []
