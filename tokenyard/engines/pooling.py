"""What a model directory says about embeddings: whether it has a generative head, and how its
sentence-transformers files pool. Shared by the engines that embed (hf-embed, vllm)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import msgspec

PoolingMode = Literal["mean", "cls", "max", "last"]
# sentence-transformers' Pooling config keys, in the order it tries them
_ST_MODES: tuple[tuple[str, PoolingMode], ...] = (
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_max_tokens", "max"),
    ("pooling_mode_lasttoken", "last"),
)
_GENERATIVE = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
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


def is_embedding_model(model: str | os.PathLike[str]) -> bool:
    """A model directory with no generative head (e.g. BertModel): it serves embeddings."""
    if str(model) == "tiny":
        return False
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        return False
    from transformers import AutoConfig

    archs = AutoConfig.from_pretrained(path, local_files_only=True).architectures or []
    return bool(archs) and not any(a.endswith(_GENERATIVE) for a in archs)
