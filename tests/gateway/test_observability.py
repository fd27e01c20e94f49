"""In-process observability: the worker's metrics, the span tree of one request, /dashboard."""

from __future__ import annotations

import io
import json
import logging
import re
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard import tracing
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.logs import Fields, JsonFormatter, TextFormatter
from tokenyard.messages import JobRecord


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, {"model": MODEL, **labels})
    return 0.0 if value is None else value


def test_worker_counts_claims_jobs_tokens_and_steps(stack: Stack) -> None:
    [(worker, _, _)] = stack.workers
    registry = worker.metrics.registry
    with stack.client() as client:
        for i in range(6):
            reply = client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": f"count {i}", "max_tokens": 5, "ignore_eos": True},
            )
            assert reply.status_code == 200, reply.text
    assert sample(registry, "tokenyard_worker_claims_total") == 6
    assert sample(registry, "tokenyard_worker_jobs_total", status="succeeded") == 6
    assert sample(registry, "tokenyard_worker_decode_tokens_total") == 30
    assert sample(registry, "tokenyard_worker_prefill_tokens_total") > 0
    assert sample(registry, "tokenyard_worker_batch_size_count") >= 5  # one per engine step
    assert sample(registry, "tokenyard_worker_step_seconds_count") > 0
    # each job's way into the batch, once per job: enqueue to claim, claim to add, first step
    for stage in ("claim_wait", "claim_to_engine", "first_step"):
        assert sample(registry, f"tokenyard_worker_{stage}_seconds_count") == 6, stage
    assert sample(registry, "tokenyard_worker_first_step_seconds_sum") > 0  # a step each, at least
    assert sample(registry, "tokenyard_worker_publish_seconds_count") >= 5  # one per delivery
    assert sample(registry, "tokenyard_worker_fenced_completions_total") == 0
    give_up = time.monotonic() + 5  # renewals and gauges move with the upkeep loop
    while sample(registry, "tokenyard_worker_lease_renewals_total") == 0:
        with stack.client() as client:
            client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "long", "max_tokens": 150, "ignore_eos": True},
            )
        assert time.monotonic() < give_up
    # the sim engine reports no KV cache and runs no GPU: those series are absent, not 0
    assert (
        registry.get_sample_value("tokenyard_worker_kv_cache_usage_ratio", {"model": MODEL}) is None
    )
    assert not any(
        s.name.startswith("tokenyard_accelerator") for m in registry.collect() for s in m.samples
    )


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    tracing.configure("tokenyard-test", spans, batch=False)
    try:
        yield spans
    finally:
        tracing.shutdown()


def test_one_trace_from_the_clients_traceparent_to_the_worker(
    valkey: EmbeddedServer, exporter: InMemorySpanExporter
) -> None:
    trace_id, parent = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    with run_stack(valkey) as stack, stack.client() as client:
        reply = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        )
        assert reply.status_code == 200
        give_up = time.monotonic() + 10
        while not any(s.name == "tokenyard.job" for s in exporter.get_finished_spans()):
            assert time.monotonic() < give_up
            time.sleep(0.05)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {f"{s.context.trace_id:032x}" for s in spans.values()} == {trace_id}
    root = spans["POST /v1/chat/completions"]
    assert root.parent is not None and f"{root.parent.span_id:016x}" == parent

    def parent_of(name: str) -> str:
        span = spans[name]
        assert span.parent is not None
        return next(s.name for s in spans.values() if s.context.span_id == span.parent.span_id)

    assert parent_of("tokenyard.admission") == root.name
    assert parent_of("tokenyard.enqueue") == root.name
    assert parent_of("tokenyard.queue_wait") == root.name
    assert parent_of("tokenyard.job") == root.name
    for step in ("tokenyard.claim", "tokenyard.prefill", "tokenyard.decode", "tokenyard.complete"):
        assert parent_of(step) == "tokenyard.job"
    job = spans["tokenyard.job"]
    assert job.attributes is not None and job.attributes["tokenyard.completion_tokens"] == 4
    assert spans["tokenyard.queue_wait"].end_time <= spans["tokenyard.prefill"].start_time  # type: ignore[operator]


def _console_spans(text: str) -> list[dict[str, Any]]:
    """The spans the console exporter printed: JSON objects one after another."""
    decoder, spans, at = json.JSONDecoder(), [], 0
    while (at := _skip_space(text, at)) < len(text):
        span, at = decoder.raw_decode(text, at)
        spans.append(span)
    return spans


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def test_every_span_lies_inside_its_parent_in_the_console_exporters_output(
    valkey: EmbeddedServer,
) -> None:
    """An idle worker waits in a blocking claim that began before the request came (the case
    that gave `tokenyard.queue_wait` a negative length): every child starts inside its parent.

    Within a process every child also ends inside its parent: the gateway's admission and
    enqueue inside its request span, the worker's steps inside `tokenyard.job`. Across the
    queue, the worker's `queue_wait` and `job` hang under the request span as a message's
    consumer does (async): they start inside it and may end after it, since a 202 leaves before
    the job ends, and even a live call's answer may leave before the worker hears that its
    completion was written. A live call's queue wait and tokens lie inside its request span.
    """
    out = io.StringIO()
    tracing.configure("tokenyard-test", ConsoleSpanExporter(out=out), batch=False)
    body = {"model": MODEL, "prompt": "nested", "max_tokens": 4, "ignore_eos": True}
    try:
        with run_stack(valkey) as stack, stack.client() as client:
            calls = {
                "sync": client.post("/v1/completions", json=body),
                "stream": client.post("/v1/completions", json={**body, "stream": True}),
                "job": client.post("/v1/jobs", json=body),
            }
            assert [r.status_code for r in calls.values()] == [200, 200, 202]
            give_up = time.monotonic() + 10
            while out.getvalue().count('"name": "tokenyard.job"') < len(calls):
                assert time.monotonic() < give_up, out.getvalue()
                time.sleep(0.02)
    finally:
        tracing.shutdown()
    spans = _console_spans(out.getvalue())
    by_id = {s["context"]["span_id"]: s for s in spans}
    for span in spans:
        span["start"] = datetime.fromisoformat(span["start_time"])
        span["end"] = datetime.fromisoformat(span["end_time"])
        assert span["start"] <= span["end"], span["name"]
    async_children = {"tokenyard.queue_wait", "tokenyard.job"}
    checked = 0
    for child in spans:
        parent = by_id.get(child["parent_id"])
        if parent is None:
            continue  # a root: the request span
        name = child["name"]
        assert parent["start"] <= child["start"], (parent["name"], name)
        if name not in async_children:
            assert child["end"] <= parent["end"], (parent["name"], name)
        checked += 1
    assert checked >= 3 * 6  # admission, enqueue, queue wait, job, claim, complete per call
    # a live call's request span lasts until its answer has gone, the stream's last token
    # included: the job was picked and its tokens made inside it
    for call in ("sync", "stream"):
        job_id = calls[call].headers["x-job-id"]
        [job] = [
            s
            for s in spans
            if s["name"] == "tokenyard.job" and s["attributes"]["tokenyard.job_id"] == job_id
        ]
        request = by_id[job["parent_id"]]
        steps = {
            s["name"]: s
            for s in spans
            if s["parent_id"] in (request["context"]["span_id"], job["context"]["span_id"])
        }
        assert steps["tokenyard.queue_wait"]["end"] <= request["end"], call
        assert steps["tokenyard.decode"]["end"] <= request["end"], call


def test_tracing_off_still_carries_the_callers_traceparent(stack: Stack) -> None:
    assert not tracing.enabled()
    traceparent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    with stack.client() as client:
        reply = client.post(
            "/v1/jobs",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"traceparent": traceparent},
        )
    assert reply.status_code == 202
    record: JobRecord = stack.call(stack.gateway_broker.queue.record(reply.json()["id"]))
    assert record.spec.trace_context == {"traceparent": traceparent}


def test_dashboard_data_needs_a_valid_key_when_keys_are_configured(
    valkey: EmbeddedServer,
) -> None:
    keyring = KeyRing({"sk-ops": Tenant("ops", admin=True), "sk-acme": Tenant("acme")})
    with run_stack(valkey, keyring=keyring) as stack, stack.client() as client:
        page = client.get("/dashboard")  # the shell holds no data; its script asks for a key
        assert page.status_code == 200 and "dashboard/data" in page.text
        assert client.get("/dashboard/data").status_code == 401
        wrong = client.get("/dashboard/data", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        tenant = client.get("/dashboard/data", headers={"Authorization": "Bearer sk-acme"})
        assert tenant.status_code == 403  # fleet-wide, every tenant's jobs: admins only
        key = {"Authorization": "Bearer sk-ops"}
        job = client.post(
            "/v1/jobs", json={"model": MODEL, "prompt": "hi", "max_tokens": 3}, headers=key
        ).json()["id"]
        give_up = time.monotonic() + 10
        while True:
            data = client.get("/dashboard/data", headers=key).json()
            jobs = {j["id"]: j for j in data["jobs"]}
            if jobs.get(job, {}).get("status") == "succeeded":
                break
            assert time.monotonic() < give_up, data
            time.sleep(0.1)
        [model] = data["models"]
        assert model["model"] == MODEL and len(model["workers"]) == 1
        assert [lane["priority"] for lane in model["lanes"]] == ["high", "normal", "low", "batch"]
        assert jobs[job]["completion_tokens"] == 3 and jobs[job]["tenant"] == "ops"


def test_the_dashboard_s_job_view_shows_timings_deliveries_worker_events_and_error(
    valkey: EmbeddedServer,
) -> None:
    keyring = KeyRing({"sk-ops": Tenant("ops", admin=True), "sk-acme": Tenant("acme")})
    with (
        run_stack(valkey, keyring=keyring, broker_options={"max_deliveries": 1}) as stack,
        stack.client() as client,
    ):
        ops, acme = {"Authorization": "Bearer sk-ops"}, {"Authorization": "Bearer sk-acme"}
        # a job read later streams its tokens as events (a sync call's job keeps only its end)
        done = client.post(
            "/v1/jobs", json={"model": MODEL, "prompt": "hi", "max_tokens": 5}, headers=acme
        ).json()
        give_up = time.monotonic() + 10
        while client.get(f"/v1/jobs/{done['id']}", headers=acme).json()["status"] != "succeeded":
            assert time.monotonic() < give_up
            time.sleep(0.05)
        failed = client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "[[fail]]", "max_tokens": 5},
            headers=acme,
        )
        assert failed.status_code == 500
        assert client.get(f"/dashboard/jobs/{done['id']}", headers=acme).status_code == 403
        view = client.get(f"/dashboard/jobs/{done['id']}", headers=ops).json()
        assert view["status"] == "succeeded" and view["tenant"] == "acme"
        assert view["deliveries"] == 1 and view["worker"] and view["error"] is None
        times = [view[k] for k in ("received_at", "started_at", "first_token_at", "finished_at")]
        assert all(t is not None for t in times) and times == sorted(times), view
        assert (
            view["events"]
            == {
                "token_events": view["events"]["token_events"],
                "tokens": 5,
                "finish": {"status": "succeeded", "finish_reason": "length"},
            }
            and view["events"]["token_events"] >= 1
        )
        assert view["completion_tokens"] == 5
        dead_id = client.get("/admin/dead_letters", headers=ops).json()["data"][0]["job_id"]
        dead = client.get(f"/dashboard/jobs/{dead_id}", headers=ops).json()
        assert dead["status"] == "dead" and dead["deliveries"] == 1 and dead["error"]
        assert dead["events"]["finish"]["status"] == "dead" and dead["events"]["tokens"] == 0
        for unknown in (
            "nope",
            "cmpl-nope",
            f"{dead_id[:-1]}0" if dead_id[-1] != "0" else f"{dead_id[:-1]}1",
        ):
            missing = client.get(f"/dashboard/jobs/{unknown}", headers=ops)
            assert missing.status_code == 404 and missing.json()["error"]["type"], missing.text


def test_dashboard_data_route_is_in_the_openapi_schema(stack: Stack) -> None:
    schema = httpx.get(f"{stack.url}/openapi.json").json()
    assert "/dashboard/data" in schema["paths"] and "/dashboard" not in schema["paths"]


def test_one_access_line_per_request_with_its_tenant_job_times_and_tokens(
    valkey: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenyard.access")
    keyring = KeyRing({"sk-acme": Tenant("acme")})
    key = {"Authorization": "Bearer sk-acme"}
    body = {"model": MODEL, "prompt": "logged", "max_tokens": 4, "ignore_eos": True}
    with run_stack(valkey, keyring=keyring) as stack, stack.client(headers=key) as client:
        sync = client.post("/v1/completions", json=body)
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        job = client.post("/v1/jobs", json=body).json()["id"]
        missing = client.get("/v1/jobs/nope")
        assert (sync.status_code, streamed.status_code, missing.status_code) == (200, 200, 404)
        assert client.get("/healthz").status_code == 200  # a probe: DEBUG, not INFO
        # each line is written once its answer has gone, streams included
        give_up = time.monotonic() + 10
        while len(lines := [r for r in caplog.records if r.name == "tokenyard.access"]) < 4:
            assert time.monotonic() < give_up, [r.getMessage() for r in lines]
            time.sleep(0.01)
    assert len(lines) == 4 and all(isinstance(r.msg, Fields) for r in lines)
    values = [r.msg.values for r in lines if isinstance(r.msg, Fields)]
    by_call = {(v["method"], v["path"], v["status"]): v for v in values}
    assert set(by_call) == {
        ("POST", "/v1/completions", 200),
        ("POST", "/v1/jobs", 202),
        ("GET", "/v1/jobs/nope", 404),
    }
    # the two completions: the sync one and the stream, told apart by their job ids
    calls = {v["job_id"]: v for v in values if v["path"] == "/v1/completions"}
    assert set(calls) == {sync.headers["x-job-id"], streamed.headers["x-job-id"]}
    for v in calls.values():
        assert v["tenant"] == "acme"
        assert v["prompt_tokens"] > 0 and v["completion_tokens"] == 4
        assert v["queue_ms"] >= 0 and 0 < v["ttft_ms"] <= v["total_ms"]
    queued = by_call["POST", "/v1/jobs", 202]
    assert queued["job_id"] == job and queued["tenant"] == "acme" and queued["ttft_ms"] is None
    assert {r.levelno for r in lines} == {logging.INFO}
    sync_id = sync.headers["x-job-id"]
    [sync_line] = [r for r in lines if f"job_id={sync_id} " in r.getMessage()]
    text = TextFormatter().format(sync_line)
    assert f"tokenyard.access POST /v1/completions 200 tenant=acme job_id={sync_id} " in text
    out = json.loads(JsonFormatter().format(sync_line))
    assert out["message"] == "POST /v1/completions 200" and out["logger"] == "tokenyard.access"
    assert out["status"] == 200 and out["completion_tokens"] == 4 and out["total_ms"] > 0


def _access_lines(caplog: pytest.LogCaptureFixture, n: int) -> list[dict[str, Any]]:
    """The values of the first `n` access lines, once written (each after its answer went)."""
    give_up = time.monotonic() + 10
    while len(lines := [r for r in caplog.records if r.name == "tokenyard.access"]) < n:
        assert time.monotonic() < give_up, [r.getMessage() for r in lines]
        time.sleep(0.01)
    assert all(isinstance(r.msg, Fields) for r in lines)
    return [r.msg.values for r in lines if isinstance(r.msg, Fields)]


def test_access_lines_give_an_errors_code_and_reason_and_the_request_id(
    valkey: EmbeddedServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenyard.access")
    keyring = KeyRing({"sk-acme": Tenant("acme")})
    key = {"Authorization": "Bearer sk-acme"}
    trace_id = uuid.uuid4().hex
    traceparent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    bad = {"model": MODEL, "prompt": "x", "max_tokens": -5}
    with run_stack(valkey, keyring=keyring) as stack, stack.client(headers=key) as client:
        refused = client.post(
            "/v1/completions",
            json=bad,
            headers={"X-Request-Id": "req-42", "traceparent": traceparent},
        )
        missing = client.get("/v1/jobs/nope")  # no id given: one is made
        unusable = client.get("/v1/models", headers={"X-Request-Id": "has a space"})
        anonymous = client.get("/v1/models", headers={"Authorization": ""})
        lines = _access_lines(caplog, 4)
    assert (refused.status_code, missing.status_code) == (400, 404)
    assert (unusable.status_code, anonymous.status_code) == (200, 401)
    assert refused.headers["x-request-id"] == "req-42"  # the caller's, echoed
    made = missing.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert unusable.headers["x-request-id"] not in ("has a space", made)
    by_id = {v["request_id"]: v for v in lines}
    assert set(by_id) == {
        r.headers["x-request-id"] for r in (refused, missing, unusable, anonymous)
    }
    for reply in (refused, missing, anonymous):  # each error's code and message, as answered
        line, error = by_id[reply.headers["x-request-id"]], reply.json()["error"]
        assert line["status"] == reply.status_code
        assert (line["error_code"], line["reason"]) == (error["code"], error["message"]), line
    assert by_id["req-42"]["error_code"] == "invalid_value" and by_id["req-42"]["tenant"] == "acme"
    assert by_id["req-42"]["trace_id"] == trace_id  # tracing off: the caller's trace
    ok = by_id[unusable.headers["x-request-id"]]
    assert ok["error_code"] is None and ok["reason"] is None and ok["trace_id"] is None
    record = logging.LogRecord(
        "tokenyard.access",
        logging.INFO,
        "",
        0,
        Fields("", by_id["req-42"], ("method", "path", "status")),
        (),
        None,
    )
    text = TextFormatter().format(record)
    assert ' POST /v1/completions 400 error_code=invalid_value reason="' in text, text
    assert " request_id=req-42 " in text and f"trace_id={trace_id}" in text


def test_access_lines_name_the_request_spans_trace_when_tracing_is_on(
    valkey: EmbeddedServer, exporter: InMemorySpanExporter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenyard.access")
    with run_stack(valkey) as stack, stack.client() as client:
        reply = client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "t", "max_tokens": 2}
        )
        [line] = _access_lines(caplog, 1)
    assert reply.status_code == 200
    [span] = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    assert line["trace_id"] == f"{span.context.trace_id:032x}"
    assert line["request_id"] == reply.headers["x-request-id"]


def test_health_answers_as_vllms_and_the_root_leads_to_the_docs(stack: Stack) -> None:
    with stack.client() as client:
        health = client.get("/health")
        root = client.get("/", follow_redirects=False)
        docs = client.get("/", follow_redirects=True)
    assert (health.status_code, health.content) == (200, b"")
    assert root.status_code == 307 and root.headers["location"] == "/docs"
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    assert "/health" in httpx.get(f"{stack.url}/openapi.json").json()["paths"]
