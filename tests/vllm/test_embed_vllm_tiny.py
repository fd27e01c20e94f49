"""A causal LM on vLLM's pooling runner (`runner="pooling"` in the engine args, the tiny model):
pooled as hf-embed pools the same directory (mean, normalised), several inputs in one job."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.embeddings import cosines, request, vectors
from tests.engines.outputs import collect
from tokenyard.engines import Engine, make_engine
from tokenyard.engines.tiny import ensure_tiny_model

pytestmark = pytest.mark.slow

TEXTS = ["hello there", "a longer input about lanes and yards", "x"]


async def embed(engine: Engine, inputs: list[list[int]]) -> np.ndarray:
    await engine.start()
    try:
        engine.add(request("j", inputs))
        out = (await collect(engine, 1))["j"].finish
    finally:
        await engine.stop()
    return vectors(out)


async def test_pooling_runner_matches_hf_embed() -> None:
    pooled = make_engine(
        "vllm",
        model="tiny",
        dtype="float32",
        max_seqs=4,
        max_model_len=512,
        enforce_eager=True,
        engine_args={"runner": "pooling"},
    )
    assert (pooled.limits().generates, pooled.limits().embeds) == (False, True)
    inputs = [pooled.tokenizer.encode(t) for t in TEXTS]
    got = await embed(pooled, inputs)
    want = await embed(make_engine("hf-embed", model=str(ensure_tiny_model(head_dim=32))), inputs)
    assert got.shape == want.shape == (3, 64)
    similar = cosines(got, want)
    assert similar.min() >= 0.999, similar
