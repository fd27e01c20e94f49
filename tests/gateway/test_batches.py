"""Files and Batches API against a real gateway, Valkey and sim workers, via the openai client."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack, slow_engine
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.auth import KeyRing, Tenant


def _client(stack: Stack, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def _jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def _request(i: int, url: str = "/v1/chat/completions", max_tokens: int = 4) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0}
    if url == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": f"question {i}"}]
    else:
        body["prompt"] = f"prompt {i}"
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def _wait(c: openai.OpenAI, batch_id: str, timeout: float = 60.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        batch = c.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


KEYS = KeyRing({"key-a": Tenant("acme"), "key-b": Tenant("globex")})


@pytest.fixture(scope="module")
def bstack(valkey: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    files = tmp_path_factory.mktemp("files")
    with run_stack(valkey, keyring=KEYS, files_dir=str(files), batch_max_in_flight=64) as s:
        yield s


def test_openai_client_batch_round_trip(bstack: Stack) -> None:
    c = _client(bstack)
    rows = [_request(i) for i in range(20)]
    up = c.files.create(file=("in.jsonl", io.BytesIO(_jsonl(rows))), purpose="batch")
    assert up.object == "file" and up.purpose == "batch" and up.bytes == len(_jsonl(rows))
    assert c.files.retrieve(up.id).filename == "in.jsonl"
    batch = c.batches.create(
        input_file_id=up.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"job": "nightly"},
    )
    assert batch.status in ("validating", "in_progress")
    assert batch.metadata == {"job": "nightly"}
    done = _wait(c, batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed) == (20, 20)
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    assert done.output_file_id is not None
    lines = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == sorted(r["custom_id"] for r in rows)
    first = lines[0]
    assert first["error"] is None and first["response"]["status_code"] == 200
    assert first["response"]["body"]["object"] == "chat.completion"
    assert first["response"]["body"]["usage"]["completion_tokens"] == 4
    # the batch ran in the batch lane
    job = first["response"]["request_id"]
    record = bstack.call(bstack.gateway_broker.queue.record(job))
    assert record.spec.priority.name == "BATCH" and record.spec.tenant == "acme"
    # list with after/limit
    other = c.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    page = c.batches.list(limit=1)
    assert [b.id for b in page.data] == [other.id] and page.has_more
    assert next(b.id for b in c.batches.list(after=other.id, limit=5).data) == batch.id
    _wait(c, other.id)


def test_tenants_see_only_their_own(bstack: Stack) -> None:
    a, b = _client(bstack, "key-a"), _client(bstack, "key-b")
    up = a.files.create(file=("x.jsonl", io.BytesIO(_jsonl([_request(0)]))), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(up.id)
    with pytest.raises(openai.NotFoundError):
        b.files.content(up.id)
    assert up.id not in [f.id for f in b.files.list().data]
    assert up.id in [f.id for f in a.files.list().data]
    with pytest.raises(openai.NotFoundError):
        b.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    batch = a.batches.create(
        input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    with pytest.raises(openai.NotFoundError):
        b.batches.retrieve(batch.id)
    assert batch.id not in [x.id for x in b.batches.list().data]
    _wait(a, batch.id)
    deleted = a.files.delete(up.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(up.id)


def test_malformed_file_fails_with_line_errors(bstack: Stack) -> None:
    c = _client(bstack)
    good = _request(1)
    raw = b"".join(
        [
            json.dumps(good).encode() + b"\n",
            b"{not json\n",
            json.dumps({**_request(2), "url": "/v1/moderations"}).encode() + b"\n",
            json.dumps({k: v for k, v in _request(3).items() if k != "custom_id"}).encode() + b"\n",
            json.dumps(good).encode() + b"\n",  # duplicate custom_id
            json.dumps({**_request(5), "url": "/v1/completions"}).encode() + b"\n",
        ]
    )
    up = c.files.create(file=("bad.jsonl", io.BytesIO(raw)), purpose="batch")
    jobs_before = len(bstack.job_ids())
    batch = _wait(
        c,
        c.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id,
    )
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None
    got = [(e.line, e.code) for e in batch.errors.data]
    assert got == [
        (2, "invalid_json_line"),
        (3, "invalid_url"),
        (4, "missing_required_parameter"),
        (5, "duplicate_custom_id"),
        (6, "mismatched_endpoint"),
    ]
    assert len(bstack.job_ids()) == jobs_before  # nothing enqueued


def test_limits_and_openai_errors(bstack: Stack) -> None:
    c = _client(bstack)
    with pytest.raises(openai.BadRequestError):
        c.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    up = c.files.create(file=("x.jsonl", io.BytesIO(_jsonl([_request(0)]))), purpose="batch")
    with pytest.raises(openai.BadRequestError) as bad:
        c.batches.create(
            input_file_id=up.id,
            endpoint="/v1/chat/completions",
            completion_window="48h",  # type: ignore[arg-type]
        )
    assert bad.value.body["param"] == "completion_window"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        c.batches.retrieve("batch_missing")
    r = httpx.post(
        bstack.url + "/v1/batches",
        headers={"Authorization": "Bearer key-a"},
        content=b"{nope",
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_admission_refusal_is_a_per_request_error(bstack: Stack) -> None:
    c = _client(bstack)
    rows = [_request(0), {**_request(1), "body": {**_request(1)["body"], "model": "nope"}}]
    up = c.files.create(file=("m.jsonl", io.BytesIO(_jsonl(rows))), purpose="batch")
    batch = _wait(
        c,
        c.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id,
    )
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 1)
    assert batch.error_file_id is not None
    err = [json.loads(x) for x in c.files.content(batch.error_file_id).text.splitlines()]
    assert [e["custom_id"] for e in err] == ["req-1"]
    assert err[0]["response"]["status_code"] == 404
    assert err[0]["response"]["body"]["error"]["code"] == "model_not_found"


def test_max_requests_limit(valkey: EmbeddedServer, tmp_path: Path) -> None:
    with run_stack(
        valkey, files_dir=str(tmp_path), batch_max_requests=3, batch_max_file_bytes=2000
    ) as s:
        c = _client(s)
        with pytest.raises(openai.APIStatusError) as big:
            c.files.create(file=("huge.jsonl", io.BytesIO(b"x" * 2001)), purpose="batch")
        assert big.value.status_code == 413
        r = httpx.post(s.url + "/v1/files", files={"file": ("a.jsonl", b"{}")})  # no purpose
        assert r.status_code == 400 and r.json()["error"]["param"] is not None, r.text
        up = c.files.create(
            file=("big.jsonl", io.BytesIO(_jsonl([_request(i) for i in range(5)]))),
            purpose="batch",
        )
        batch = _wait(
            c,
            c.batches.create(
                input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id,
        )
        assert batch.status == "failed"
        assert batch.errors is not None and batch.errors.data[0].code == "too_many_requests"
        assert s.job_ids() == []


def test_cancel_mid_batch(valkey: EmbeddedServer, tmp_path: Path) -> None:
    with run_stack(
        valkey,
        engines=[slow_engine(0.02)],
        files_dir=str(tmp_path),
        batch_max_in_flight=4,
        worker_options={"max_seqs": 2},
    ) as s:
        c = _client(s)
        rows = [_request(i, max_tokens=5) for i in range(200)]
        up = c.files.create(file=("c.jsonl", io.BytesIO(_jsonl(rows))), purpose="batch")
        batch = c.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        end = time.monotonic() + 30
        while True:
            now = c.batches.retrieve(batch.id)
            assert now.request_counts is not None
            if now.request_counts.completed >= 5:
                break
            assert time.monotonic() < end
            time.sleep(0.02)
        cancelling = c.batches.cancel(batch.id)
        assert cancelling.status == "cancelling"
        done = _wait(c, batch.id)
        assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
        assert done.request_counts is not None
        completed = done.request_counts.completed
        assert 5 <= completed < 200
        out = [json.loads(x) for x in c.files.content(done.output_file_id or "").text.splitlines()]
        assert len(out) == completed
        assert all(x["response"]["status_code"] == 200 for x in out)
        # the rest never ran: no more jobs than completed plus what was in flight
        assert len(s.job_ids()) <= completed + 4
        time.sleep(0.3)
        assert c.batches.retrieve(batch.id).request_counts.completed == completed  # type: ignore[union-attr]
        with pytest.raises(openai.ConflictError):
            c.batches.cancel(batch.id)


def test_ten_thousand_requests_exact_counts(valkey: EmbeddedServer, tmp_path: Path) -> None:
    n = 10_000
    with run_stack(
        valkey,
        files_dir=str(tmp_path),
        batch_max_in_flight=1024,
        worker_options={"max_seqs": 512},
    ) as s:
        c = _client(s)
        rows = [_request(i, url="/v1/completions", max_tokens=1) for i in range(n)]
        up = c.files.create(file=("big.jsonl", io.BytesIO(_jsonl(rows))), purpose="batch")
        started = time.monotonic()
        batch = _wait(
            c,
            c.batches.create(
                input_file_id=up.id, endpoint="/v1/completions", completion_window="24h"
            ).id,
            timeout=120,
        )
        took = time.monotonic() - started
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (n, n, 0)
        out = c.files.content(batch.output_file_id or "").text.splitlines()
        ids = [json.loads(x)["custom_id"] for x in out]
        assert len(ids) == n and set(ids) == {f"req-{i}" for i in range(n)}
        assert len(s.job_ids()) == n
        print(f"10k batch: {took:.1f} s, {n / took:.0f} requests/s")


def test_cli_submit_wait_results_status(bstack: Stack, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tokenyard.cli import app

    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl([_request(i, url="/v1/completions") for i in range(10)]))
    common = ["--url", bstack.url, "--api-key", "key-a"]
    runner = CliRunner()
    saved = tmp_path / "out.jsonl"
    done = runner.invoke(
        app, ["batch", "submit", str(src), "--wait", "--output", str(saved), *common]
    )
    assert done.exit_code == 0, done.output
    batch_id = done.stdout.splitlines()[0]
    assert batch_id.startswith("batch_")
    assert len(saved.read_text().splitlines()) == 10
    shown = runner.invoke(app, ["batch", "results", batch_id, *common])
    assert shown.exit_code == 0
    assert sorted(json.loads(x)["custom_id"] for x in shown.stdout.splitlines()) == sorted(
        f"req-{i}" for i in range(10)
    )
    status = runner.invoke(app, ["batch", "status", batch_id, "--as-json", *common])
    assert json.loads(status.stdout)["request_counts"]["completed"] == 10
    refused = runner.invoke(app, ["batch", "cancel", batch_id, *common])
    assert refused.exit_code == 1
    assert "409" in refused.output


def test_expiry_keeps_what_completed(valkey: EmbeddedServer, tmp_path: Path) -> None:
    n = 100
    with run_stack(
        valkey,
        engines=[slow_engine(0.02)],
        files_dir=str(tmp_path),
        batch_max_in_flight=4,
        batch_window_s=2,
        worker_options={"max_seqs": 2},
    ) as s:
        c = _client(s)
        rows = [_request(i, max_tokens=5) for i in range(n)]
        up = c.files.create(file=("e.jsonl", io.BytesIO(_jsonl(rows))), purpose="batch")
        batch = c.batches.create(
            input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.expires_at - batch.created_at == 2
        done = _wait(c, batch.id, timeout=30)
        assert done.status == "expired" and done.expired_at
        out = c.files.content(done.output_file_id or "").text.splitlines()
        err = [json.loads(x) for x in c.files.content(done.error_file_id or "").text.splitlines()]
        assert 0 < len(out) < n
        assert len(out) + len(err) == n  # every request answered once, in one file or the other
        assert {e["error"]["code"] for e in err} == {"batch_expired"}


def test_tenant_quota_applies_to_batch_jobs(bstack: Stack) -> None:
    from tokenyard.tenancy.limiter import Quota
    from tokenyard.tenancy.records import TenantConfig

    broker = bstack.gateway_broker
    bstack.call(
        broker.directory.put_tenant(TenantConfig(name="globex", quota=Quota(max_concurrent=2)))
    )
    try:
        c = _client(bstack, "key-b")
        rows = [_request(i) for i in range(12)]
        up = c.files.create(file=("q.jsonl", io.BytesIO(_jsonl(rows))), purpose="batch")
        done = _wait(
            c,
            c.batches.create(
                input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id,
        )
        # refused reservations wait and retry: the batch completes, nothing fails
        assert done.status == "completed"
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
        jobs = [
            json.loads(x)["response"]["request_id"]
            for x in c.files.content(done.output_file_id or "").text.splitlines()
        ]
        records = bstack.call(broker.queue.records(jobs))
        assert all(r is not None and r.spec.quota for r in records)  # reserved, then settled
    finally:
        bstack.call(broker.directory.put_tenant(TenantConfig(name="globex")))
