"""LoRA adapters end to end: the tiny Llama on CPU with PEFT adapters built here, through the
gateway over real HTTP with the official openai client (tokenyard/gateway/adapters.py,
tokenyard/engines/lora.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("peft")

from tests.gateway.conftest import Stack, run_stack
from tests.loras import build_lora, peft_greedy
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.auth import KeyRing, Tenant

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": "Bearer sk-ops"}
PROMPT = "Once upon a time there was"
N = 12


@pytest.fixture(scope="module")
def loras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tokenyard.engines.tiny import ensure_tiny_model

    root = tmp_path_factory.mktemp("loras")
    model = ensure_tiny_model()
    return {
        "tiny": model,
        "storyteller": build_lora(model, root / "storyteller", seed=11),
        "coder": build_lora(model, root / "coder", seed=12, rank=8),
    }


@pytest.fixture(scope="module")
def lora_stack(valkey: EmbeddedServer, loras: dict[str, Path]) -> Iterator[Stack]:
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    given = {"storyteller": str(loras["storyteller"])}
    keyring = KeyRing({"sk-ops": Tenant("ops", admin=True), "sk-user": Tenant("user")})
    with run_stack(
        valkey,
        model="tiny",
        tokenizer=load_tokenizer("hf", "tiny"),
        keyring=keyring,
        engines=[
            lambda: make_engine(
                "hf", model="tiny", max_seqs=8, max_tokens=4096, threads=1, loras=given
            )
        ],
        worker_options={"engine": "hf", "loras": ("storyteller=" + given["storyteller"],)},
    ) as stack:
        _wait_listed(_client(stack), "storyteller")  # the worker announces it once started
        yield stack


def _wait_listed(client: openai.OpenAI, *names: str, timeout_s: float = 60.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not set(names) <= {m.id for m in client.models.list().data}:
        assert time.monotonic() < give_up, f"{names} never listed"
        time.sleep(0.05)


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="sk-user", max_retries=0)


def _complete(client: openai.OpenAI, model: str, prompt: str = PROMPT) -> Any:
    return client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=N,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


def _ids(completion: Any) -> list[int]:
    return list(completion.choices[0].model_extra["token_ids"])


def test_adapter_greedy_equals_peft_generate(lora_stack: Stack, loras: dict[str, Path]) -> None:
    from tokenyard.gateway.tokenizers import load_tokenizer

    prompt_ids = load_tokenizer("hf", "tiny").encode(PROMPT)
    client = _client(lora_stack)
    base = _complete(client, "tiny")  # first: the adapter's answer must not be its cached one
    story = _complete(client, "storyteller")
    assert _ids(base) == peft_greedy(loras["tiny"], None, prompt_ids, N)
    assert _ids(story) == peft_greedy(loras["tiny"], loras["storyteller"], prompt_ids, N)
    assert _ids(story) != _ids(base)  # the adapter changes the output
    assert story.model == "storyteller"  # answered under the name asked, as vLLM does
    again = _complete(client, "storyteller")  # a cached (or collapsed) answer is its own
    assert _ids(again) == _ids(story)
    # the audit trail names the adapter a job ran with
    _, entries = lora_stack.call(lora_stack.gateway_broker.audit.audit_entries(0.0, model="tiny"))
    ran = {(e.event, e.adapter) for e in entries if e.status in ("queued", "succeeded")}
    assert {("received", "storyteller"), ("terminal", "storyteller")} <= ran
    assert ("terminal", None) in ran  # the base's job
    with httpx.Client(base_url=lora_stack.url, timeout=30) as http:
        metrics = http.get("/metrics", headers=ADMIN).text
    routed = 'tokenyard_routed_requests_total{model="tiny",requested="storyteller",rule="adapter"}'
    assert routed in metrics
    # a call's metrics are the adapter's own, as the name it asked (its base's apart)
    assert 'tokenyard_generation_tokens_total{model="storyteller"}' in metrics
    assert 'tokenyard_generation_tokens_total{model="tiny"}' in metrics


def test_models_lists_adapters_with_their_base(lora_stack: Stack, loras: dict[str, Path]) -> None:
    cards = {m.id: m for m in _client(lora_stack).models.list().data}
    story = cards["storyteller"].model_extra or {}
    assert story["parent"] == "tiny"
    assert story["root"] == str(loras["storyteller"].resolve())
    assert (cards["tiny"].model_extra or {})["parent"] is None
    with pytest.raises(openai.NotFoundError):
        _complete(_client(lora_stack), "no-such-adapter")
    with pytest.raises(openai.BadRequestError, match="LoRA adapter"):
        _client(lora_stack).embeddings.create(model="storyteller", input="hi")


def test_adapter_added_by_admin_route_is_usable(lora_stack: Stack, loras: dict[str, Path]) -> None:
    from tokenyard.gateway.tokenizers import load_tokenizer

    client = _client(lora_stack)
    with pytest.raises(openai.NotFoundError):
        _complete(client, "coder")
    body = {"name": "coder", "model": "tiny", "path": str(loras["coder"])}
    with httpx.Client(base_url=lora_stack.url, timeout=30) as http:
        refused = http.post("/admin/loras", json=body, headers={"Authorization": "Bearer sk-user"})
        assert refused.status_code == 403
        wrong = http.post("/admin/loras", json={**body, "model": "nope"}, headers=ADMIN)
        assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"
        taken = http.post("/admin/loras", json={**body, "name": "tiny"}, headers=ADMIN)
        assert taken.status_code == 409, taken.text
        added = http.post("/admin/loras", json=body, headers=ADMIN)
        assert added.status_code == 201, added.text
        listed = http.get("/admin/loras", headers=ADMIN).json()["data"]
        assert {a["name"] for a in listed} == {"storyteller", "coder"}
    prompt_ids = load_tokenizer("hf", "tiny").encode(PROMPT)
    # loaded by the worker from the path the job carries: it was never given it
    assert _ids(_complete(client, "coder")) == peft_greedy(
        loras["tiny"], loras["coder"], prompt_ids, N
    )
    with httpx.Client(base_url=lora_stack.url, timeout=30) as http:
        assert http.delete("/admin/loras/coder", headers=ADMIN).status_code == 200
        assert http.delete("/admin/loras/coder", headers=ADMIN).status_code == 404


def test_adapter_in_chat_jobs_and_messages(lora_stack: Stack) -> None:
    client = _client(lora_stack)
    messages = [{"role": "user", "content": PROMPT}]
    chat = client.chat.completions.create(
        model="storyteller",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=N,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    base = client.chat.completions.create(
        model="tiny",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=N,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert chat.model == "storyteller"
    response = client.responses.create(
        model="storyteller",
        input=messages,  # type: ignore[arg-type]
        max_output_tokens=N,
        temperature=0.0,
    )
    plain = client.chat.completions.create(
        model="storyteller",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=N,
        temperature=0.0,
    )
    assert response.model == "storyteller"
    assert response.output_text == plain.choices[0].message.content
    assert chat.choices[0].message.content != base.choices[0].message.content
    with httpx.Client(base_url=lora_stack.url, timeout=60) as http:
        headers = {"Authorization": "Bearer sk-user"}
        job = http.post(
            "/v1/jobs",
            json={
                "model": "storyteller",
                "messages": messages,
                "max_tokens": N,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            headers=headers,
        )
        assert job.status_code in (200, 201, 202), job.text
        assert job.json()["model"] == "storyteller"
        job_id = job.json()["id"]
        text = None
        give_up = time.monotonic() + 60
        while text is None and time.monotonic() < give_up:
            got = http.get(f"/v1/jobs/{job_id}", headers=headers).json()
            if got["status"] == "succeeded":
                text = got["result"]["text"]
            time.sleep(0.05)
        assert text == chat.choices[0].message.content
        answer = http.post(
            "/v1/messages",
            json={
                "model": "storyteller",
                "messages": messages,
                "max_tokens": N,
                "temperature": 0.0,
            },
            headers={**headers, "anthropic-version": "2023-06-01"},
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "storyteller"


def test_an_adapters_jobs_go_to_the_worker_that_holds_it(
    valkey: EmbeddedServer, loras: dict[str, Path]
) -> None:
    """Adapter affinity (the broker's prefix affinity, keyed by the adapter): of two idle
    workers, the one that loaded the adapter claims its later jobs, whatever their prompts;
    the other never loads it. The wait is long here so a slow host cannot make it lapse."""
    from tokenyard.engines import make_engine
    from tokenyard.engines.hf import HFEngine
    from tokenyard.gateway.tokenizers import load_tokenizer

    given = {"storyteller": str(loras["storyteller"]), "coder": str(loras["coder"])}

    def engine() -> HFEngine:
        made = make_engine("hf", model="tiny", max_seqs=4, max_tokens=2048, threads=1, loras=given)
        assert isinstance(made, HFEngine)
        return made

    with run_stack(
        valkey,
        model="tiny",
        tokenizer=load_tokenizer("hf", "tiny"),
        engines=[engine, engine],
        worker_options={"engine": "hf", "loras": tuple(f"{n}={p}" for n, p in given.items())},
        broker_options={"affinity_wait_s": 30.0},
    ) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        _wait_listed(client, "storyteller", "coder")  # workers announce once started
        # one adapter's jobs one after another: with no affinity the two idle workers take
        # turns (the one blocked longest in its claim gets the next job), and both load it
        for name in ("storyteller", "coder"):
            for i in range(4):
                client.completions.create(
                    model=name, prompt=f"story number {i} of {name}", max_tokens=2,
                    temperature=0.0,
                )  # fmt: skip
        loads = {}
        for worker, _, _ in stack.workers:
            lora = worker.engine._lora  # type: ignore[attr-defined]
            assert lora is not None
            for name in ("storyteller", "coder"):
                loads.setdefault(name, []).append(lora.loads_of.get(name, 0))
        # each adapter was loaded once, by one worker, which ran all its jobs
        assert sorted(loads["storyteller"]) == [0, 1], loads
        assert sorted(loads["coder"]) == [0, 1], loads
