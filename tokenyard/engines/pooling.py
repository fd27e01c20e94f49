"""What a model directory says about embeddings: its architectures (whether it has a generative
head), how its sentence-transformers files pool, and an embeddings job's inputs. Shared by the
engines that embed (hf-embed, vllm) and by `--engine auto`."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec

from tokenyard import limits
from tokenyard.engines.models import TINY_MODELS
from tokenyard.errors import InvalidRequest
from tokenyard.messages import ModelLimits, PoolingOptions

PoolingMode = Literal["mean", "cls", "max", "last"]
# sentence-transformers' Pooling config keys, in the order it tries them
_ST_MODES: tuple[tuple[str, PoolingMode], ...] = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_lasttoken", "last"),
)
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_CLASSIFIER = "ForSequenceClassification"
# the architecture of the `tiny` model (engines/tiny.py builds a Llama)
_TINY_ARCHITECTURES = ("LlamaForCausalLM",)
# token ids of the embeddings jobs an engine holds at once: they wait as ids, not activations
DEFAULT_TOKEN_BUDGET = 1 << 20


class Pooling(msgspec.Struct, frozen=True):
    """How a vector is made from an input's last hidden state."""

    mode: PoolingMode = "mean"
    normalize: bool = True
    max_seq_length: int | None = None  # sentence-transformers' own limit, below the model's


def read_pooling(path: Path) -> Pooling:
    """The pooling a model directory's sentence-transformers files describe; without them,
    mean pooling, normalised."""
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    mode: PoolingMode = "mean"
    for module in modules:
        if str(module.get("type", "")).endswith(".Pooling"):
            config = json.loads((path / module.get("path", "") / "config.json").read_text())
            mode = next((m for key, m in _ST_MODES if config.get(key)), "mean")
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    max_len: int | None = None
    st_config = path / "sentence_bert_config.json"
    if st_config.is_file():
        max_len = json.loads(st_config.read_text()).get("max_seq_length")
    return Pooling(mode, normalize, max_len)


def model_architectures(model: str | os.PathLike[str]) -> tuple[str, ...]:
    """The architectures a local model directory's config.json names ("tiny": a Llama); ()
    when it names none or there is none."""
    if str(model) in TINY_MODELS:
        return _TINY_ARCHITECTURES
    config = Path(model).expanduser() / "config.json"
    try:
        archs = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(str(a) for a in archs)


def is_cross_encoder(model: str | os.PathLike[str]) -> bool:
    """A model directory with a sequence-classification head: it scores text pairs."""
    return any(a.endswith(_CLASSIFIER) for a in model_architectures(model))


def require_one_label(path: Path) -> dict[str, Any]:
    """A cross-encoder's config.json; ValueError when its classifier has other than one label
    (a classifier of several is no cross-encoder: its outputs are no one score)."""
    config = model_config(path)
    labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
    if labels != 1:
        raise ValueError(
            f"{path} classifies into {labels} labels: a cross-encoder (scores) has one"
        )
    return config


def model_config(path: Path) -> dict[str, Any]:
    """A model directory's config.json ({} without one)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def read_matryoshka(path: Path) -> tuple[bool, tuple[int, ...]]:
    """Whether a model's vectors may be shortened, and to which sizes (() any): its config's
    `matryoshka_dimensions`, or `is_matryoshka`, as vLLM reads them."""
    config = model_config(path)
    sizes = config.get("matryoshka_dimensions") or ()
    if sizes:
        return True, tuple(sorted(int(d) for d in sizes))
    return bool(config.get("is_matryoshka")), ()


def is_embedding_model(model: str | os.PathLike[str]) -> bool:
    """A model directory with no generative head (e.g. BertModel): it serves embeddings."""
    archs = model_architectures(model)
    return bool(archs) and not any(a.endswith(_GENERATIVE) for a in archs)


def split_inputs(
    prompt: Sequence[int],
    lengths: Sequence[int],
    model_limits: ModelLimits,
    pooling: PoolingOptions | None = None,
) -> list[list[int]]:
    """An embeddings or scoring job's inputs (its token ids, one input after another, of
    `lengths`), checked by the one rule; InvalidRequest when the job is at fault."""
    limits.check(limits.embedding_refusal(lengths, model_limits, token_ids=prompt, pooling=pooling))
    if sum(lengths) != len(prompt):
        raise InvalidRequest("input lengths do not add up to the token ids", param="input")
    inputs, at = [], 0
    for n in lengths:
        inputs.append(list(prompt[at : at + n]))
        at += n
    return inputs
