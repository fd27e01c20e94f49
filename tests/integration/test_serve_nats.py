"""`tokenyard serve --broker nats --model org/name --served-model-name tiny,yard-tiny` end to
end: a private nats-server, a worker on the tiny Llama (found under a hub id in a Hugging Face
cache, offline, as a model fetched earlier is) and the gateway, answering the official openai
client under the served names; no Redis anywhere."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.sse import events
from tests.hub import REPO, hub_cache
from tests.servers import alive
from tokenyard.fleet.launch import Processes, free_port, tokenyard_command, wait_ready

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

BROKER = "nats"  # the private server serve starts
MODEL = "tiny"  # what the API calls the model; ALIAS: its other served name
ALIAS = "yard-tiny"


@dataclass
class Served:
    url: str
    data_dir: Path
    procs: Processes

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        for child in (task / "children").read_text().split():
            found |= {int(child), *_children(int(child))}
    return found


def children_running(pid: int, program: str) -> set[int]:
    """The descendants of `pid` running the program named `program`."""
    found = set()
    for child in _children(pid):
        try:
            argv0 = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]
        except FileNotFoundError:
            continue
        # a server may retitle itself ("valkey-server 127.0.0.1:port"): the first word names it
        if Path(argv0.decode()).name.split(" ")[0] == program:
            found.add(child)
    return found


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("serve-nats")
    port = free_port()
    # nothing from the environment picks the broker: serve's own nats-server is the only one
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    env["TOKENYARD_GATEWAY_FILES_DIR"] = str(tmp / "files")
    # the model by its hub id, from a cache and never the network
    hub_cache(tmp / "hub")
    env |= {"HF_HUB_CACHE": str(tmp / "hub"), "HF_HUB_OFFLINE": "1"}
    procs = Processes()
    serve = procs.start(
        "serve",
        tokenyard_command(
            "serve", "--broker", BROKER, "--model", REPO, "--port", str(port),
            "--served-model-name", MODEL, "--served-model-name", ALIAS,
            "--max-seqs", "8", "--data-dir", str(tmp / BROKER),
        ),
        env=env,
        cwd=tmp,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url + "/readyz", procs, timeout_s=180, interval_s=0.5)
        servers = children_running(serve.pid, "nats-server")
        if BROKER == "nats":
            assert len(servers) == 1, "serve runs one private nats-server"
        yield Served(url, tmp / BROKER, procs)
        # SIGINT: the workers drain, then the nats-server stops, then serve exits cleanly
        serve.send_signal(signal.SIGINT)
        assert serve.wait(120) == 0
        assert not {pid for pid in servers if alive(pid)}, "nats-server left running"
    finally:
        procs.stop(timeout_s=30, sig=signal.SIGKILL)
    if BROKER == "nats":
        assert (tmp / BROKER / "jetstream").is_dir()  # streams kept for the next serve


def test_the_hub_model_is_served_under_its_names(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as http:
        listed = http.get("/v1/models").json()
        assert [card["id"] for card in listed["data"]] == [MODEL, ALIAS]
        # the worker registered under the first name: the lanes' and the answers' name
        assert http.get("/readyz").json()["workers"] == {MODEL: 1}
        body = {"prompt": "The yard", "max_tokens": 4, "temperature": 0.0}
        by_alias = http.post("/v1/completions", json=body | {"model": ALIAS})
        by_name = http.post("/v1/completions", json=body | {"model": MODEL})
        by_repo = http.post("/v1/completions", json=body | {"model": REPO})
    assert by_alias.status_code == by_name.status_code == 200, (by_alias.text, by_name.text)
    assert by_alias.json()["model"] == by_name.json()["model"] == MODEL
    assert by_alias.json()["choices"][0]["text"] == by_name.json()["choices"][0]["text"]
    # named otherwise, the hub id is not one of its names (as vLLM)
    assert by_repo.status_code == 404 and by_repo.json()["error"]["code"] == "model_not_found"


def test_sync_completion(served: Served) -> None:
    whole = served.client().completions.create(
        model=MODEL, prompt="The queue holds", max_tokens=8, temperature=0.0
    )
    assert whole.id.startswith("cmpl-") and whole.object == "text_completion"
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and 1 <= whole.usage.completion_tokens <= 8


def test_streamed_chat_equals_the_whole_answer(served: Served) -> None:
    client = served.client()
    messages: Any = [{"role": "user", "content": "Once upon a time"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0.0
    )
    text = whole.choices[0].message.content
    assert text is not None

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0.0,
            stream=True,
            extra_body={"cache": False},  # generated again, not replayed from the cache
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_job_events_resume_from_last_event_id(served: Served) -> None:
    body = {
        "model": MODEL,
        "prompt": "Every request waits in the queue",
        # the worker sends what the engine made since its last write, so a busy machine
        # coalesces tokens: 128 of them leave several events to drop the stream between
        "max_tokens": 128,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    with httpx.Client(base_url=served.url, timeout=60) as http:
        job = http.post("/v1/jobs", json=body)
        assert job.status_code == 202, job.text
        job_id = job.json()["id"]

        seen: list[str] = []
        ids: list[str] = []
        with http.stream("GET", f"/v1/jobs/{job_id}/events") as first:
            assert first.headers["content-type"].startswith("text/event-stream")
            for ev in events(first):
                assert ev.event == "tokens" and ev.id is not None
                seen.append(ev.json()["text"])
                ids.append(ev.id)
                break  # drop the connection after the first

        finish = None
        with http.stream(
            "GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": ids[-1]}
        ) as second:
            for ev in events(second):
                assert ev.id is not None and ev.id not in ids  # nothing twice
                if ev.event == "finish":
                    finish = ev.json()
                    break
                seen.append(ev.json()["text"])
                ids.append(ev.id)
        assert finish is not None and finish["status"] == "succeeded"
        assert len(seen) > 1  # the resumed stream carried the rest, from where the first left
        assert "".join(seen) == finish["text"]

        record = http.get(f"/v1/jobs/{job_id}").json()
        assert record["status"] == "succeeded"


def test_a_small_batch_through_files_and_batches(served: Served) -> None:
    client = served.client()
    rows = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"question {i}"}],
                "max_tokens": 4,
                "temperature": 0.0,
            },
        }
        for i in range(5)
    ]
    raw = b"".join(json.dumps(row).encode() + b"\n" for row in rows)
    upload = client.files.create(file=("in.jsonl", io.BytesIO(raw)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    give_up = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < give_up, f"batch {batch.id} still {batch.status}"
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 0)
    assert batch.output_file_id is not None
    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in lines) == [f"req-{i}" for i in range(5)]
    assert all(x["error"] is None and x["response"]["status_code"] == 200 for x in lines)
    assert all(x["response"]["body"]["object"] == "chat.completion" for x in lines)
