"""SSE resume: a dropped stream reconnects with Last-Event-ID and misses nothing."""

from __future__ import annotations

from tests.gateway.conftest import MODEL, run_stack, slow_engine
from tests.gateway.sse import events
from tokenyard.broker.redis.embedded import EmbeddedServer

PROMPT = "The queue holds every request"


def test_job_events_resume_equals_uninterrupted_run(valkey: EmbeddedServer) -> None:
    with run_stack(valkey, engines=[slow_engine(0.01)]) as stack, stack.client() as http:
        reference = http.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 40,
                "temperature": 0.0,
            },
        ).json()["choices"][0]["text"]

        job = http.post(
            "/v1/jobs",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0},
        )
        assert job.status_code == 202, job.text
        job_id = job.json()["id"]

        seen: list[str] = []
        last_id = None
        with http.stream("GET", f"/v1/jobs/{job_id}/events") as first:
            assert first.headers["content-type"].startswith("text/event-stream")
            for ev in events(first):
                assert ev.event == "tokens"
                seen.append(ev.json()["text"])
                last_id = ev.id
                if len(seen) == 5:
                    break  # drop the connection midway
        assert last_id is not None

        finish = None
        with http.stream(
            "GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last_id}
        ) as second:
            for ev in events(second):
                assert ev.id is not None and ev.id > last_id
                if ev.event == "finish":
                    finish = ev.json()
                    break
                seen.append(ev.json()["text"])
        assert finish is not None and finish["status"] == "succeeded"
        assert "".join(seen) == reference == finish["text"]

        # a reconnect after the last event ends at once instead of hanging
        with http.stream(
            "GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "99999999999999-0"}
        ) as done:
            assert list(events(done)) == []


def test_openai_stream_reconnects_through_the_job_events(valkey: EmbeddedServer) -> None:
    """With a resume grace, a dropped /v1/completions stream continues via cmpl-<id>/events."""
    with (
        run_stack(valkey, engines=[slow_engine(0.01)], stream_resume_grace_s=5.0) as stack,
        stack.client() as http,
    ):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.0}
        reference = http.post("/v1/completions", json=body).json()["choices"][0]["text"]

        texts: list[str] = []
        last_id = completion_id = None
        with http.stream(
            "POST", "/v1/completions", json={**body, "stream": True, "cache": False}
        ) as first:
            for ev in events(first):
                chunk = ev.json()
                completion_id = chunk["id"]
                texts.append(chunk["choices"][0]["text"])
                last_id = ev.id
                if len(texts) == 4:
                    break
        assert completion_id is not None and completion_id.startswith("cmpl-")
        assert last_id is not None

        with http.stream(
            "GET", f"/v1/jobs/{completion_id}/events", headers={"Last-Event-ID": last_id}
        ) as second:
            tail = list(events(second))
        assert tail[-1].data == "[DONE]"
        chunks = [ev.json() for ev in tail[:-1]]
        assert all(c["id"] == completion_id for c in chunks)
        texts += [c["choices"][0]["text"] for c in chunks]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(texts) == reference
