"""Fixtures for engine tests: the tiny local model, built once per cache directory."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    pytest.importorskip("transformers")
    from tokenyard.engines.tiny import ensure_tiny_model

    # The shared cache (TOKENYARD_CACHE_DIR or ~/.cache/tokenyard) makes reruns fast.
    return ensure_tiny_model()
