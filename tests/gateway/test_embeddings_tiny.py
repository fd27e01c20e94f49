"""/v1/embeddings on the tiny Llama (hf-embed over its base model), and refused by a model
whose workers only generate."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer


def test_a_model_that_only_generates_refuses_embeddings(stack: Stack) -> None:
    with stack.client() as http:
        r = http.post("/v1/embeddings", json={"model": MODEL, "input": ["a", "b"]})
    assert r.status_code == 400, r.text
    # refused at the gateway once the sim worker published its limits, else by its scheduler
    assert "embeddings" in r.json()["error"]["message"]


@pytest.mark.slow
def test_tiny_model_embeds_over_http(valkey: EmbeddedServer) -> None:
    pytest.importorskip("transformers")
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    with run_stack(
        valkey,
        model="tiny",
        tokenizer=load_tokenizer("hf", "tiny"),
        engines=[lambda: make_engine("hf-embed", model="tiny", threads=1)],
        worker_options={"engine": "hf-embed"},
    ) as stack:
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
        out = client.embeddings.create(model="tiny", input=["The queue holds", "a job"])
        vectors = np.asarray([d.embedding for d in out.data])
        assert vectors.shape == (2, 64)
        assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="The queue", max_tokens=4)
