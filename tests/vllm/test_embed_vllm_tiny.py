"""A causal LM on vLLM's pooling runner (`runner="pooling"` in the engine args, the tiny model):
pooled as hf-embed pools the same directory (mean, normalised), several inputs in one job."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from tests.engines.outputs import collect
from tokenyard.engines import Engine, EngineRequest, make_engine
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.messages import SamplingParams

pytestmark = pytest.mark.slow

EMBED = SamplingParams(max_tokens=0, temperature=0.0)
TEXTS = ["hello there", "a longer input about lanes and yards", "x"]


async def embed(engine: Engine, inputs: list[list[int]]) -> np.ndarray:
    flat = [i for x in inputs for i in x]
    await engine.start()
    try:
        engine.add(EngineRequest("j", flat, EMBED, input_lengths=[len(x) for x in inputs]))
        out = (await collect(engine, 1))["j"].finish
    finally:
        await engine.stop()
    assert out is not None and out.embeddings is not None, out
    return np.stack([np.frombuffer(v, "<f4") for v in out.embeddings])


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
    cosines = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cosines.min() >= 0.999, cosines
