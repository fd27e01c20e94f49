"""LoRA adapters in the hf engine: real forward passes, checked against PEFT's own generate."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("peft")

from tests.engines.outputs import collect
from tests.loras import build_lora, peft_greedy
from tokenyard.engines import EngineRequest
from tokenyard.engines.hf import HFEngine
from tokenyard.errors import EngineError, FatalError, InvalidRequest
from tokenyard.messages import SamplingParams

PROMPTS = ["The queue holds", "Once upon a time there was", "def add(a, b):"]
N = 16


def greedy(n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "a1": build_lora(tiny_model_path, root / "a1", seed=1),
        # another rank and other modules: the stacked weights mix both layouts
        "a2": build_lora(
            tiny_model_path, root / "a2", seed=2, rank=8, targets=("k_proj", "up_proj")
        ),
        "a3": build_lora(tiny_model_path, root / "a3", seed=3),
    }


@pytest.fixture
async def engine(tiny_model_path: Path, adapters: dict[str, Path]) -> AsyncIterator[HFEngine]:
    eng = HFEngine(
        str(tiny_model_path),
        max_seqs=16,
        max_tokens=8192,
        threads=1,
        loras={"a1": str(adapters["a1"]), "a2": str(adapters["a2"])},
        max_loras=2,
    )
    await eng.start()
    yield eng
    await eng.stop()


async def _run(engine: HFEngine, jobs: list[tuple[str, str, str | None]]) -> dict[str, list[int]]:
    """Add every job at once (one engine step takes them all), return each one's tokens."""
    tok = engine.tokenizer
    for seq_id, prompt, adapter in jobs:
        engine.add(EngineRequest(seq_id, tok.encode(prompt), greedy(), adapter=adapter))
    done = await collect(engine, len(jobs))
    return {seq_id: done[seq_id].token_ids for seq_id, _, _ in jobs}


async def test_adapter_output_equals_peft_generate(
    engine: HFEngine, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    tok = engine.tokenizer
    ids = tok.encode(PROMPTS[0])
    base = peft_greedy(tiny_model_path, None, ids, N)
    for name in ("a1", "a2"):
        want = peft_greedy(tiny_model_path, adapters[name], ids, N)
        assert want != base  # the adapter changes the output
        got = await _run(engine, [(f"x-{name}", PROMPTS[0], name)])
        assert got[f"x-{name}"] == want


async def test_one_step_mixes_base_and_two_adapters(engine: HFEngine) -> None:
    alone: dict[str, list[int]] = {}
    jobs = [
        (f"{adapter or 'base'}-{i}", prompt, adapter)
        for i, prompt in enumerate(PROMPTS)
        for adapter in (None, "a1", "a2")
    ]
    for seq_id, prompt, adapter in jobs:
        alone |= await _run(engine, [(seq_id, prompt, adapter)])
    assert engine._lora is not None
    before = engine._lora.mixed_passes
    mixed = await _run(engine, [(f"m-{s}", p, a) for s, p, a in jobs])
    for seq_id, _, _ in jobs:
        assert mixed[f"m-{seq_id}"] == alone[seq_id], seq_id
    # passes ran base tokens beside both adapters (padding aside, every decode step does)
    assert engine._lora.mixed_passes > before
    # and they differ: each sequence ran with its own weights
    assert len({tuple(alone[f"{a}-0"]) for a in ("base", "a1", "a2")}) == 3


async def test_adapter_from_a_jobs_path_and_lru(
    engine: HFEngine, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    ids = engine.tokenizer.encode(PROMPTS[1])
    want = peft_greedy(tiny_model_path, adapters["a3"], ids, N)
    tok = engine.tokenizer
    engine.add(
        EngineRequest(
            "p", tok.encode(PROMPTS[1]), greedy(), adapter="a3", adapter_path=str(adapters["a3"])
        )
    )
    assert (await collect(engine, 1))["p"].token_ids == want
    await _run(engine, [("q1", PROMPTS[1], "a1"), ("q2", PROMPTS[1], "a2")])
    assert engine._lora is not None
    assert sorted(engine._lora.resident) == ["a1", "a2"]  # a3, least recent, was evicted


async def test_ready_for_loads_an_adapter_off_the_loop_once(
    engine: HFEngine, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    lora = engine._lora
    assert lora is not None and "a3" not in lora.resident
    path = str(adapters["a3"])
    await engine.ready_for(greedy(), "a3", path)  # the worker's step before `add`
    assert "a3" in lora.resident and lora.users("a3") == 0 and lora.loads_of["a3"] == 1
    tok = engine.tokenizer
    engine.add(
        EngineRequest("r", tok.encode(PROMPTS[1]), greedy(), adapter="a3", adapter_path=path)
    )
    assert lora.loads_of["a3"] == 1 and lora.users("a3") == 1  # found loaded, not read again
    ids = tok.encode(PROMPTS[1])
    assert (await collect(engine, 1))["r"].token_ids == peft_greedy(
        tiny_model_path, adapters["a3"], ids, N
    )
    await engine.ready_for(greedy(), "nope")  # never raises: add refuses it by name
    with pytest.raises(InvalidRequest, match="does not exist"):
        engine.add(EngineRequest("n", [1, 2, 3], greedy(), adapter="nope"))


async def test_unknown_adapter_is_refused(engine: HFEngine) -> None:
    with pytest.raises(InvalidRequest, match="does not exist"):
        engine.add(EngineRequest("u", [1, 2, 3], greedy(), adapter="nope"))


async def test_a_refused_sequence_does_not_pin_its_adapter(engine: HFEngine) -> None:
    engine.add(EngineRequest("dup", [1, 2, 3], greedy(), adapter="a1"))
    with pytest.raises(EngineError):  # the same id again: refused after the adapter loaded
        engine.add(EngineRequest("dup", [1, 2, 3], greedy(), adapter="a1"))
    await collect(engine, 1)
    assert engine._lora is not None
    assert engine._lora.users("a1") == 0  # the refused one holds nothing


async def test_adapters_in_an_engine_process(
    tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    """The engine in a child process (`engine_process`): the adapter crosses the pipe with
    the request."""
    from tokenyard.engines.process import ProcessEngine

    options = {
        "model": str(tiny_model_path),
        "max_seqs": 4,
        "max_tokens": 4096,
        "threads": 1,
        "loras": {"a1": str(adapters["a1"])},
    }
    engine = ProcessEngine("hf", options)
    assert engine.runs_adapters
    await engine.start()
    try:
        prompt = engine.tokenizer.encode(PROMPTS[2])
        engine.add(EngineRequest("pa", prompt, greedy(), adapter="a1"))
        engine.add(EngineRequest("pn", prompt, greedy(), adapter="nope"))
        done = await collect(engine, 2, timeout=120)
    finally:
        await engine.stop()
    assert done["pa"].token_ids == peft_greedy(tiny_model_path, adapters["a1"], prompt, N)
    refused = done["pn"].finish
    assert refused is not None and refused.refused and "does not exist" in (refused.error or "")


def test_the_resident_set_evicts_only_unused_adapters_least_recent_first() -> None:
    """LoraSet's bookkeeping with a loader that makes adapters in memory (a real Linear
    model): eviction order, in-use adapters kept past max_loras, reloads counted."""
    import torch

    from tokenyard.engines.lora import LoraSet, _Adapter

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))

    def loader(name: str, path: str, modules: object, dtype: torch.dtype) -> _Adapter:
        return _Adapter(name, path, 1.0, 1, {"0": (torch.ones(1, 4), torch.ones(4, 1))})

    lora = LoraSet(
        model, {n: f"/{n}" for n in "abc"}, max_loras=2, dtype=torch.float32, loader=loader
    )
    lora.ensure("a")
    lora.ensure("b")
    lora.ensure("c")  # a and b in use: all three stay resident
    assert lora.resident == ["a", "b", "c"]
    lora.release("a")
    lora.release("b")
    lora.ensure("b")  # resident: no load, most recent now
    assert lora.loads == 3 and lora.resident == ["a", "c", "b"]
    lora.release("b")
    lora.release("c")
    lora.ensure("d", "/d")  # a job's path; over the bound: a, then c (least recent unused) go
    assert lora.resident == ["b", "d"]
    lora.ensure("a")  # loaded again
    assert lora.loads_of["a"] == 2
    with pytest.raises(InvalidRequest):
        lora.ensure("e")  # no path anywhere


def test_adapters_without_peft_stop_the_engine_at_once(
    tiny_model_path: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # an install without the hf extra's peft: refused when the worker starts, not job by job
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "peft" else found(name, *a)
    )
    with pytest.raises(FatalError, match="peft"):
        HFEngine(str(tiny_model_path), threads=1, loras={"a1": str(adapters["a1"])})
