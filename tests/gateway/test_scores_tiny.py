"""vLLM's /v1/score and /v1/rerank over real HTTP on a small random-weight BERT cross-encoder
built here (hf-embed, one job through the queue), held to sentence-transformers' CrossEncoder
(the scores vLLM matches), in vLLM's response shapes; and embeddings' `dimensions`,
`normalize` and `truncate_prompt_tokens` with the official client on a matryoshka BERT."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from tests.embeddings import tiny_bert
from tests.gateway.conftest import Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import wait_ready

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RERANKER = "reranker"
EMBEDDER = "mbert"
QUERY = "what does the queue hold"
DOCS = [
    "the queue holds jobs",
    "a cat sat on the mat",
    "workers pull work from lanes",
    "the yard sorts cars onto lanes",
]
# vLLM's ScoreResponse, ScoreResponseData and RerankResponse, RerankResult, RerankDocument
SCORE_KEYS = {"id", "object", "created", "model", "data", "usage"}
RERANK_KEYS = {"id", "model", "usage", "results"}


def _serve(valkey: EmbeddedServer, model: str, path: Path) -> Any:
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    return run_stack(
        valkey,
        model=model,
        tokenizer=load_tokenizer("hf", str(path)),
        # "hf" picks hf-embed for a directory with no generative head
        engines=[lambda: make_engine("hf", model=str(path), threads=1)],
        worker_options={"engine": "hf"},
    )


@pytest.fixture(scope="module")
def reranker_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("reranker"), cross_encoder=True)


@pytest.fixture(scope="module")
def rstack(valkey: EmbeddedServer, reranker_path: Path) -> Iterator[Stack]:
    with _serve(valkey, RERANKER, reranker_path) as stack:
        wait_ready(stack.url + "/readyz", timeout_s=30, interval_s=0.05)
        yield stack


def _cross_encoder(path: Path, pairs: list[tuple[str, str]], activate: bool = True) -> np.ndarray:
    """sentence-transformers' own scores of `pairs` (its activation: a sigmoid, or none)."""
    import torch
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(path), device="cpu")
    fn = None if activate else torch.nn.Identity()
    return np.asarray(model.predict(pairs, activation_fn=fn), dtype=np.float64)


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_score_matches_sentence_transformers_in_vllms_shape(
    rstack: Stack, reranker_path: Path
) -> None:
    pairs = [(QUERY, d) for d in DOCS]
    want = _cross_encoder(reranker_path, pairs)
    with rstack.client() as http:
        r = http.post("/v1/score", json={"model": RERANKER, "text_1": QUERY, "text_2": DOCS})
        assert r.status_code == 200, r.text
        assert r.headers["x-job-id"]
        doc = r.json()
        assert set(doc) == SCORE_KEYS and doc["object"] == "list" and doc["model"] == RERANKER
        assert doc["id"].startswith("score-")
        assert [(d["index"], d["object"]) for d in doc["data"]] == [(i, "score") for i in range(4)]
        assert np.allclose([d["score"] for d in doc["data"]], want, atol=1e-5)
        usage = doc["usage"]
        assert set(usage) == {
            "prompt_tokens",
            "total_tokens",
            "completion_tokens",
            "prompt_tokens_details",
            "completion_tokens_details",
        }
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(reranker_path)
        tokens = sum(len(tok(a, b)["input_ids"]) for a, b in pairs)
        assert usage["prompt_tokens"] == usage["total_tokens"] == tokens
        # the job ran through the queue like any other: the jobs API has it
        job = http.get(f"/v1/jobs/{r.headers['x-job-id']}")
        assert job.status_code == 200 and job.json()["status"] == "succeeded", job.text

        # vLLM's other names of the two fields, pairwise (N:N), and the alias route
        firsts = ["the queue", "a dog"]
        seconds = ["holds jobs", "sat on the mat"]
        pairwise = _cross_encoder(reranker_path, list(zip(firsts, seconds, strict=True)))
        for body in (
            {"data_1": firsts, "data_2": seconds},
            {"queries": firsts, "documents": seconds},
            {"queries": firsts, "items": seconds},
            {"text_1": firsts, "text_2": seconds},
        ):
            got = _post(http, "/score", {"model": RERANKER, **body})
            assert np.allclose([d["score"] for d in got["data"]], pairwise, atol=1e-5), body
        # the model may be left out: the one this server serves
        alone = _post(http, "/v1/score", {"text_1": QUERY, "text_2": DOCS[0]})
        assert alone["data"][0]["score"] == pytest.approx(want[0], abs=1e-5)
        # use_activation false (and its old name softmax): the classifier's raw logit
        raw = _cross_encoder(reranker_path, pairs, activate=False)
        for name in ("use_activation", "softmax"):
            body = {"model": RERANKER, "text_1": QUERY, "text_2": DOCS, name: False}
            got = _post(http, "/v1/score", body)
            assert np.allclose([d["score"] for d in got["data"]], raw, atol=1e-5)
        assert not np.allclose(raw, want, atol=1e-3)


def test_rerank_orders_documents_as_vllm_answers(rstack: Stack, reranker_path: Path) -> None:
    want = _cross_encoder(reranker_path, [(QUERY, d) for d in DOCS])
    order = [int(i) for i in np.argsort(-want)]
    with rstack.client() as http:
        for route in ("/v1/rerank", "/rerank", "/v2/rerank"):
            doc = _post(http, route, {"model": RERANKER, "query": QUERY, "documents": DOCS})
            assert set(doc) == RERANK_KEYS and doc["id"].startswith("rerank-")
            assert [x["index"] for x in doc["results"]] == order
            for x in doc["results"]:
                assert set(x) == {"index", "document", "relevance_score"}
                assert x["document"] == {"text": DOCS[x["index"]], "multi_modal": None}
                assert x["relevance_score"] == pytest.approx(want[x["index"]], abs=1e-5)
            assert set(doc["usage"]) == {"prompt_tokens", "total_tokens"}
            assert doc["usage"]["prompt_tokens"] == doc["usage"]["total_tokens"] > 0
        top = _post(
            http,
            "/v1/rerank",
            {"model": RERANKER, "query": QUERY, "documents": DOCS, "top_n": 2},
        )
        assert [x["index"] for x in top["results"]] == order[:2]
        bare = _post(
            http,
            "/v1/rerank",
            {"query": QUERY, "documents": DOCS, "return_documents": False, "top_n": -1},
        )
        assert [x["index"] for x in bare["results"]] == order
        assert all("document" not in x for x in bare["results"])


def test_truncate_prompt_tokens_cuts_each_pair_as_vllm_does(
    rstack: Stack, reranker_path: Path
) -> None:
    """vLLM's cut of a pair: no `truncation_side`, the tokenizer's own pair truncation (its
    side, the longer text first, special tokens kept); a side, the whole pair's ids and token
    types sliced there."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    long_doc = "workers pull work from the lanes of the yard and the queue holds the jobs"
    tok = AutoTokenizer.from_pretrained(reranker_path)
    model = AutoModelForSequenceClassification.from_pretrained(reranker_path)

    def score(enc: Any) -> float:
        with torch.inference_mode():
            return float(torch.sigmoid(model(**enc).logits[0, 0]))

    own = score(tok(QUERY, long_doc, truncation=True, max_length=12, return_tensors="pt"))
    whole_pair = tok(QUERY, long_doc, return_tensors="pt")
    left = score({k: v[:, -12:] for k, v in whole_pair.items()})
    right = score({k: v[:, :12] for k, v in whole_pair.items()})
    with rstack.client() as http:
        body = {"model": RERANKER, "text_1": QUERY, "text_2": long_doc}
        full = _post(http, "/v1/score", body)
        for extra, want in (
            ({}, own),
            ({"truncation_side": "left"}, left),
            ({"truncation_side": "right"}, right),
        ):
            cut = _post(http, "/v1/score", {**body, "truncate_prompt_tokens": 12, **extra})
            assert cut["usage"]["prompt_tokens"] == 12 < full["usage"]["prompt_tokens"]
            assert cut["data"][0]["score"] == pytest.approx(want, abs=1e-5), extra
        assert len({own, left, right, full["data"][0]["score"]}) == 4  # each cut differs
        whole = _post(http, "/v1/score", {**body, "truncate_prompt_tokens": -1})
        assert whole["data"] == full["data"]  # -1: the model's context, which it fits


def test_scores_cache_and_refusals(rstack: Stack) -> None:
    body = {"model": RERANKER, "text_1": "a cat", "text_2": ["the dog", "the mat"]}
    with rstack.client() as http:
        first = http.post("/v1/score", json=body)
        assert first.headers["x-cache"] == "miss"
        again = http.post("/v1/score", json=body)
        assert again.headers["x-cache"] == "hit"
        assert again.json()["data"] == first.json()["data"]
        # the options are part of what is cached: raw logits are another answer
        raw = http.post("/v1/score", json={**body, "use_activation": False})
        assert raw.headers["x-cache"] == "miss" and raw.json()["data"] != first.json()["data"]

        def refused(path: str, payload: dict[str, Any], param: str, code: str | None = None) -> str:
            r = http.post(path, json=payload)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param, error
            if code is not None:
                assert error["code"] == code, error
            return str(error["message"])

        score = {"model": RERANKER, "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}
        assert "1:1, 1:N or N:N" in refused("/v1/score", score, "text_1")
        refused("/v1/score", {"model": RERANKER, "text_1": "a"}, "text_1")
        refused("/v1/score", {"model": RERANKER, "text_1": "a", "data_2": "b"}, "text_1")
        refused("/v1/score", {**body, "truncate_prompt_tokens": 65}, "truncate_prompt_tokens")
        refused("/v1/score", {**body, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")
        refused("/v1/score", {**body, "temperature": 0}, "temperature", "unknown_parameter")
        refused("/v1/score", {**body, "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs")
        refused("/v1/score", {**body, "use_activation": True, "softmax": False}, "use_activation")
        rerank = {"model": RERANKER, "query": "q", "documents": ["word " * 70]}
        refused("/v1/rerank", rerank, "documents", "context_length_exceeded")
        refused("/v1/rerank", {"model": RERANKER, "query": "q", "documents": []}, "documents")
        # a cross-encoder neither embeds nor generates: each refused by name
        message = refused("/v1/embeddings", {"model": RERANKER, "input": "x"}, "model")
        assert "embeddings" in message
        message = refused("/v1/completions", {"model": RERANKER, "prompt": "x"}, "model")
        assert "scores only" in message
        missing = http.post("/v1/score", json={**body, "model": "nope"})
        assert missing.status_code == 404
        # the OpenAPI document offers score and rerank for this model, embeddings not at all
        paths = http.get("/openapi.json").json()["paths"]
        assert "/v1/score" in paths and "/v1/rerank" in paths and "/v1/embeddings" not in paths


# -- embeddings' vLLM options on a matryoshka BERT ---------------------------------------------


@pytest.fixture(scope="module")
def embedder_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("mbert"), matryoshka_dimensions=[8, 16])


@pytest.fixture(scope="module")
def estack(valkey: EmbeddedServer, embedder_path: Path) -> Iterator[Stack]:
    with _serve(valkey, EMBEDDER, embedder_path) as stack:
        wait_ready(stack.url + "/readyz", timeout_s=30, interval_s=0.05)
        yield stack


def _mean_pooled(path: Path, ids: list[list[int]]) -> np.ndarray:
    """Each input's mean-pooled last hidden state, unnormalised (transformers' own)."""
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path)
    out = []
    with torch.inference_mode():
        for x in ids:
            hidden = model(input_ids=torch.tensor([x])).last_hidden_state[0]
            out.append(hidden.mean(0).numpy())
    return np.asarray(out, dtype=np.float64)


def test_embeddings_dimensions_normalize_and_truncation(estack: Stack, embedder_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedder_path)
    texts = ["the queue holds jobs", "workers pull work from the lanes of the yard"]
    raw = _mean_pooled(embedder_path, [tok(t)["input_ids"] for t in texts])
    client = openai.OpenAI(base_url=estack.url + "/v1", api_key="unused", max_retries=0)

    def vectors(**kwargs: Any) -> np.ndarray:
        out = client.embeddings.create(model=EMBEDDER, input=texts, **kwargs)
        return np.asarray([d.embedding for d in out.data], dtype=np.float64)

    full = vectors()  # no sentence-transformers files: normalised, as vLLM's default
    assert full.shape == (2, 32)
    assert np.allclose(full, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-5)
    # dimensions: the first n values, then normalised (vLLM's order)
    short = vectors(dimensions=16)
    want = raw[:, :16] / np.linalg.norm(raw[:, :16], axis=1, keepdims=True)
    assert short.shape == (2, 16) and np.allclose(short, want, atol=1e-5)
    # normalize false: the pooled vectors as they are (with use_activation, its newer name)
    for name in ("normalize", "use_activation"):
        assert np.allclose(vectors(extra_body={name: False}), raw, atol=1e-4)
    plain = vectors(dimensions=8, extra_body={"normalize": False})
    assert np.allclose(plain, raw[:, :8], atol=1e-4)
    # truncate_prompt_tokens: each input's last n tokens, its [CLS] and [SEP] kept (vLLM's
    # left truncation), for text and token ids alike
    cut = tok(texts[1], truncation=True, max_length=6)["input_ids"]
    tok.truncation_side = "left"
    left = tok(texts[1], truncation=True, max_length=6)["input_ids"]
    assert left != cut
    out = client.embeddings.create(
        model=EMBEDDER, input=texts[1], extra_body={"truncate_prompt_tokens": 6, "normalize": False}
    )
    assert out.usage.prompt_tokens == 6
    assert np.allclose(out.data[0].embedding, _mean_pooled(embedder_path, [left])[0], atol=1e-4)
    ids = tok(texts[1])["input_ids"]
    by_ids = client.embeddings.create(
        model=EMBEDDER, input=[ids], extra_body={"truncate_prompt_tokens": 5, "normalize": False}
    )
    assert np.allclose(
        by_ids.data[0].embedding, _mean_pooled(embedder_path, [ids[-5:]])[0], atol=1e-4
    )
    right = client.embeddings.create(
        model=EMBEDDER,
        input=texts[1],
        extra_body={"truncate_prompt_tokens": 6, "truncation_side": "right", "normalize": False},
    )
    assert np.allclose(right.data[0].embedding, _mean_pooled(embedder_path, [cut])[0], atol=1e-4)

    def refused(param: str, **kwargs: Any) -> str:
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=EMBEDDER, input=texts, **kwargs)
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == param, error
        return str(error["message"])

    assert "only supports [8, 16] matryoshka dimensions" in refused("dimensions", dimensions=12)
    refused("truncate_prompt_tokens", extra_body={"truncate_prompt_tokens": 65})
    refused("use_activation", extra_body={"normalize": True, "use_activation": False})
    # a cross-encoder's routes refuse an embedding model by name
    with estack.client() as http:
        r = http.post("/v1/rerank", json={"model": EMBEDDER, "query": "q", "documents": ["d"]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "model" and error["code"] == "model_not_supported"
        assert f"'{EMBEDDER}' is not a cross-encoder" in error["message"]
