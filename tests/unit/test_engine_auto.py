"""`--engine auto`: the one decision over what is installed, the device and the model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import msgspec
import pytest

from tokenyard.config import CONFIG_ENV, WorkerSettings
from tokenyard.engines.auto import (
    EngineChoice,
    EngineFacts,
    choose_engine,
    engine_facts,
    settled_engine,
)
from tokenyard.engines.pooling import model_architectures

LLAMA = ("LlamaForCausalLM",)
CPU_VLLM = EngineFacts(
    vllm_version="0.32.0+cpu",
    vllm_build="cpu",
    vllm_architectures=frozenset({"LlamaForCausalLM", "BertModel"}),
    model_architectures=LLAMA,
    device="auto",
    cuda=False,
)


def test_vllm_runs_where_installed_fitting_the_device_and_supporting_the_model() -> None:
    choice = choose_engine(CPU_VLLM)
    assert choice == EngineChoice(
        "vllm", "vllm 0.32.0+cpu installed, supports LlamaForCausalLM on CPU"
    )
    gpu = EngineFacts(
        vllm_version="0.32.0",
        vllm_build="gpu",
        vllm_architectures=frozenset(LLAMA),
        model_architectures=LLAMA,
        device="cuda:1",
        cuda=True,
    )
    assert choose_engine(gpu).engine == "vllm"
    assert "on GPU" in choose_engine(gpu).reason
    # a cross-encoder vLLM knows: its pooling runner scores it
    cross_encoder = ("BertForSequenceClassification",)
    scorer = choose_engine(
        msgspec.structs.replace(
            CPU_VLLM,
            vllm_architectures=frozenset(cross_encoder),
            model_architectures=cross_encoder,
        )
    )
    assert scorer.engine == "vllm" and "BertForSequenceClassification" in scorer.reason


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"vllm_version": None}, "vllm not installed"),
        (
            {"vllm_architectures": None, "vllm_error": "ImportError: no"},
            "vllm 0.32.0+cpu unusable: ImportError: no",
        ),
        ({"model_architectures": ("MambaForCausalLM",)}, "does not support MambaForCausalLM"),
        ({"model_architectures": ()}, "architecture is unknown"),
        # a cross-encoder vLLM does not know
        (
            {"model_architectures": ("BertForSequenceClassification",)},
            "does not support BertForSequenceClassification",
        ),
        ({"cuda": True}, "is the CPU build; the device is a GPU"),
        ({"device": "cuda"}, "is the CPU build; the device is a GPU"),
        ({"vllm_build": "gpu"}, "needs a GPU; none here"),
        ({"vllm_build": "gpu", "cuda": True, "device": "cpu"}, "a GPU build; device cpu asked"),
    ],
)
def test_otherwise_transformers_saying_why(change: dict[str, object], reason: str) -> None:
    import msgspec

    choice = choose_engine(msgspec.structs.replace(CPU_VLLM, **change))
    assert choice.engine == "hf"
    assert reason in choice.reason


def test_architectures_come_from_the_model_directory(tmp_path: Path) -> None:
    assert model_architectures("tiny") == LLAMA
    assert model_architectures(str(tmp_path)) == ()  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    assert model_architectures(str(tmp_path)) == ("BertModel",)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_without_vllm_the_facts_stop_at_the_first() -> None:
    facts = engine_facts("tiny", "auto")
    assert facts.vllm_version is None
    assert choose_engine(facts) == EngineChoice("hf", "vllm not installed")


def test_an_engine_set_anywhere_is_used_as_set(tmp_path: Path) -> None:
    assert WorkerSettings().engine == "auto"
    assert settled_engine("sim", "tiny", "auto", "flag") == ("sim", "set by --engine")
    env = "TOKENYARD_WORKER_ENGINE"
    assert settled_engine("hf", "tiny", "auto", env) == ("hf", f"set by {env}")
    where = f"file {tmp_path / 'c.toml'} ({CONFIG_ENV})"
    assert settled_engine("vllm", "tiny", "auto", where).reason == f"set by {where}"
