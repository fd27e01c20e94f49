"""/v1/score and /v1/rerank through a worker on the vLLM engine serving a cross-encoder (a small
random-weight BERT built here, on vLLM's pooling runner with its `classify` task), held to
transformers' own scores of the same pairs (token types included) and, field by field and
value by value, to `vllm serve` on the same directory.

Runs under `make test-vllm`; one `vllm serve` and one stack serve the module."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.embeddings import tiny_bert
from tests.engines.upstream import process
from tests.gateway.conftest import Stack, run_stack
from tests.vllm.test_parity_vllm_serve import differences, shape
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import free_port, wait_ready

pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = "reranker"
QUERY = "what does the queue hold"
DOCS = [
    "the queue holds jobs",
    "a cat sat on the mat",
    "workers pull work from lanes",
    "the yard sorts cars onto lanes",
]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # heads 32 wide: vLLM's CPU attention has no kernel for narrower ones
    return tiny_bert(tmp_path_factory.mktemp("ce"), cross_encoder=True, hidden_size=64)


@pytest.fixture(scope="module")
def yard(valkey: EmbeddedServer, path: Path) -> Iterator[Stack]:
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    def engine() -> Any:
        made = make_engine("vllm", model=str(path), dtype="float32", max_seqs=4, enforce_eager=True)
        limits = made.limits()
        assert (limits.generates, limits.embeds, limits.scores) == (False, False, True)
        return made

    with run_stack(
        valkey,
        model=MODEL,
        tokenizer=load_tokenizer("hf", str(path)),
        engines=[engine],
        worker_options={"engine": "vllm"},
        start_timeout_s=300,
    ) as stack:
        wait_ready(stack.url + "/readyz", timeout_s=300, interval_s=0.1)
        yield stack


@pytest.fixture(scope="module")
def serve(path: Path, yard: Stack) -> Iterator[str]:
    """`vllm serve` on the same directory (started after `yard`, which has the CPU first)."""
    port = free_port()
    cmd = [
        str(Path(sys.executable).parent / "vllm"), "serve", str(path),
        "--served-model-name", MODEL, "--dtype", "float32", "--runner", "pooling",
        "--max-num-seqs", "4", "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with process(cmd, f"http://127.0.0.1:{port}", "/v1/models", 300) as url:
        yield url


def _transformers(path: Path, pairs: list[tuple[str, str]]) -> np.ndarray:
    """transformers' logits of `pairs`, each encoded as the tokenizer encodes a pair."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    with torch.inference_mode():
        return np.asarray(
            [float(model(**tok(a, b, return_tensors="pt")).logits[0, 0]) for a, b in pairs]
        )


def _post(base: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base + route, json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, (base, route, r.text)
    out: dict[str, Any] = r.json()
    return out


def _scores(answer: dict[str, Any]) -> list[float]:
    return [d["score"] for d in answer["data"]]


def test_the_vllm_engine_scores_pairs_as_transformers_does(yard: Stack, path: Path) -> None:
    pairs = [(QUERY, d) for d in DOCS]
    logits = _transformers(path, pairs)
    got = _post(yard.url, "/v1/score", {"text_1": QUERY, "text_2": DOCS})
    assert np.allclose(_scores(got), 1 / (1 + np.exp(-logits)), atol=1e-4), got
    raw = _post(yard.url, "/v1/score", {"text_1": QUERY, "text_2": DOCS, "use_activation": False})
    assert np.allclose(_scores(raw), logits, atol=1e-4), raw
    # pairwise, with the second texts' token types: as transformers reads them
    firsts, seconds = ["the queue", "a dog"], ["holds jobs", "sat on the mat"]
    pairwise = _post(yard.url, "/v1/score", {"queries": firsts, "documents": seconds})
    want = _transformers(path, list(zip(firsts, seconds, strict=True)))
    assert np.allclose(_scores(pairwise), 1 / (1 + np.exp(-want)), atol=1e-4)
    ranked = _post(yard.url, "/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert [x["index"] for x in ranked["results"]] == [int(i) for i in np.argsort(-logits)[:2]]
    # a completion on a cross-encoder is refused by what its worker publishes
    r = httpx.post(yard.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_supported", r.text


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS}),
        ("/v1/score", {"queries": ["the queue", "a dog"], "documents": ["holds jobs", "sat"]}),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS[0], "use_activation": False}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2}),
        # (vLLM takes no `return_documents`: it shows the documents whatever it says)
        ("/v1/score", {"text_1": QUERY, "text_2": DOCS, "truncate_prompt_tokens": 6}),
        (
            "/v1/score",
            {
                "text_1": QUERY,
                "text_2": DOCS,
                "truncate_prompt_tokens": 6,
                "truncation_side": "left",
            },
        ),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "truncate_prompt_tokens": 7}),
    ],
)
def test_same_answers_as_vllm_serve(
    yard: Stack, serve: str, route: str, body: dict[str, Any]
) -> None:
    theirs = _post(serve, route, body)
    ours = _post(yard.url, route, body)
    assert shape(ours) == shape(theirs), differences(shape(ours), shape(theirs))
    assert ours["usage"] == theirs["usage"]
    if route == "/v1/score":
        assert np.allclose(_scores(ours), _scores(theirs), atol=1e-4), (ours, theirs)
    else:
        assert [x["index"] for x in ours["results"]] == [x["index"] for x in theirs["results"]]
        assert [x.get("document") for x in ours["results"]] == [
            x.get("document") for x in theirs["results"]
        ]
        got = [x["relevance_score"] for x in ours["results"]]
        assert np.allclose(got, [x["relevance_score"] for x in theirs["results"]], atol=1e-4)
