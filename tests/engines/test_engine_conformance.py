"""The engine conformance cases (tests/engines/conformance.py) on the sim and hf engines."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.engines.conformance import (
    CASE_IDS,
    CASES,
    SLOTS,
    Subject,
    greedy,
    hf_reference,
)
from tests.engines.outputs import collect
from tokenyard.engines import EngineRequest, make_engine
from tokenyard.engines.sim import SimEngine

pytestmark = pytest.mark.slow


def fast_sim() -> SimEngine:
    return SimEngine(
        max_seqs=SLOTS,
        prefill_base=0.0,
        prefill_per_token=0.0,
        decode_base=0.002,
        decode_per_seq=0.0,
    )


def sim_reference() -> object:
    async def reference(prompt: list[int], n: int) -> list[int]:
        # the direct call: the same request alone in a fresh engine
        engine = fast_sim()
        await engine.start()
        try:
            engine.add(EngineRequest("ref", prompt, greedy(n)))
            return (await collect(engine, 1))["ref"].token_ids
        finally:
            await engine.stop()

    return reference


@pytest.fixture(params=["sim", "hf"])
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[Subject]:
    if request.param == "sim":
        engine = fast_sim()
        subject = Subject(engine, sim_reference())  # type: ignore[arg-type]
    else:
        pytest.importorskip("transformers")
        from tokenyard.engines.tiny import ensure_tiny_model

        path = ensure_tiny_model()
        engine = make_engine("hf", model=str(path), max_seqs=SLOTS, max_tokens=8192, threads=1)
        subject = Subject(engine, hf_reference(path))
    await engine.start()
    yield subject
    await engine.stop()


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
async def test_conformance(subject: Subject, case: object) -> None:
    await case(subject)  # type: ignore[operator]
