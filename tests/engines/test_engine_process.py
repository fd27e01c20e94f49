"""ProcessEngine: the sim and tiny HF engines in a child process behave like the in-thread ones."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.engines.outputs import collect
from tokenyard.engines import EngineRequest, StepOutput, make_engine
from tokenyard.engines.process import ProcessEngine, make_engine_in_process
from tokenyard.engines.sim import SimEngine
from tokenyard.errors import EngineClosed, EngineError, InvalidRequest
from tokenyard.messages import Feature, FinishReason, Guide, SamplingParams

# One child per engine kind for the module: spawning one costs seconds (torch import).
pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = ["The queue holds", "Once upon a time there was", "def add(a, b):", "Le café"]
SIM = {"max_seqs": 16, "decode_base": 0.002, "decode_per_seq": 1e-4}


def hf_options(path: Path) -> dict[str, Any]:
    return {"model": str(path), "max_seqs": 16, "max_tokens": 8192, "threads": 1}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["sim", "hf"])
def kind(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    if request.param == "sim":
        return "sim", dict(SIM)
    path: Path = request.getfixturevalue("tiny_model_path")
    return "hf", hf_options(path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def proc_engine(kind: tuple[str, dict[str, Any]]) -> AsyncIterator[ProcessEngine]:
    name, options = kind
    eng = ProcessEngine(name, options)
    await eng.start()
    yield eng
    await eng.stop()


async def test_greedy_matches_in_thread_engine(
    proc_engine: ProcessEngine, kind: tuple[str, dict[str, Any]]
) -> None:
    name, options = kind
    local = make_engine(name, **options)
    await local.start()
    try:
        tok = local.tokenizer
        for engine in (local, proc_engine):
            for i, p in enumerate(PROMPTS):
                engine.add(EngineRequest(f"g{i}", tok.encode(p), greedy(20)))
        want = await collect(local, len(PROMPTS))
        got = await collect(proc_engine, len(PROMPTS))
    finally:
        await local.stop()
    assert proc_engine.capacity == local.capacity
    assert proc_engine.tokenizer.max_model_len == local.tokenizer.max_model_len
    for i, p in enumerate(PROMPTS):
        w, g = want[f"g{i}"], got[f"g{i}"]
        assert g.token_ids == w.token_ids and len(g.token_ids) == 20
        assert g.text == w.text
        assert g.finish is not None and w.finish is not None
        assert g.finish.finish_reason is FinishReason.LENGTH
        assert g.finish.completion_tokens == 20
        assert g.finish.prompt_tokens == len(proc_engine.tokenizer.encode(p))


async def test_sixteen_concurrent_sequences(proc_engine: ProcessEngine) -> None:
    tok = proc_engine.tokenizer
    before = proc_engine.stats()
    for i in range(16):
        proc_engine.add(
            EngineRequest(f"c{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), greedy(6 + i))
        )
    res = await collect(proc_engine, 16)
    for i in range(16):
        r = res[f"c{i}"]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
        assert len(r.token_ids) == r.finish.completion_tokens == 6 + i
    stats = proc_engine.stats()  # the child's, as attached to its last batch
    assert stats.tokens_generated - before.tokens_generated == sum(6 + i for i in range(16))
    assert stats.steps > before.steps and stats.running == 0
    assert stats.mean_batch > 1


async def test_refusals_are_raised_in_the_parent(proc_engine: ProcessEngine) -> None:
    tok = proc_engine.tokenizer
    with pytest.raises(InvalidRequest, match="empty"):
        proc_engine.add(EngineRequest("e0", [], greedy(4)))
    with pytest.raises(InvalidRequest) as refused:
        proc_engine.add(
            EngineRequest("e0", tok.encode("hi"), greedy(proc_engine.tokenizer.max_model_len))
        )
    assert refused.value.code == "context_length_exceeded"
    proc_engine.add(EngineRequest("e1", tok.encode("hello"), greedy(3)))
    with pytest.raises(EngineError, match="already in the engine"):
        proc_engine.add(EngineRequest("e1", tok.encode("hello"), greedy(3)))
    assert proc_engine.stats().reserved_tokens == len(tok.encode("hello")) + 3
    assert (await collect(proc_engine, 1))["e1"].finish is not None
    # The parent accounts for the child's capacity: past it, add refuses at once.
    n = proc_engine.capacity.max_seqs
    for i in range(n):
        proc_engine.add(EngineRequest(f"f{i}", tok.encode("x"), greedy(2)))
    with pytest.raises(EngineError, match="full"):
        proc_engine.add(EngineRequest("one-more", tok.encode("x"), greedy(2)))
    await collect(proc_engine, n)
    assert proc_engine.stats().running == 0


async def test_abort(proc_engine: ProcessEngine) -> None:
    tok = proc_engine.tokenizer
    proc_engine.add(EngineRequest("long", tok.encode("long story"), greedy(2000)))
    proc_engine.add(EngineRequest("short", tok.encode("short"), greedy(5)))
    seen: dict[str, list[StepOutput]] = {}
    async with asyncio.timeout(30):
        while not any(o.token_ids for o in seen.get("long", [])):
            for out in await proc_engine.outputs():
                seen.setdefault(out.seq_id, []).append(out)
    proc_engine.abort("long")
    proc_engine.abort("never-added")  # ignored

    def done(seq_id: str) -> bool:
        return any(o.finish_reason for o in seen.get(seq_id, []))

    async with asyncio.timeout(30):
        while not (done("long") and done("short")):
            for out in await proc_engine.outputs():
                seen.setdefault(out.seq_id, []).append(out)
    assert seen["long"][-1].finish_reason is FinishReason.CANCELLED
    assert seen["long"][-1].completion_tokens < 2000
    assert sum(len(o.token_ids) for o in seen["short"]) == 5
    await asyncio.sleep(0.1)
    assert proc_engine.stats().running == 0


async def test_resume_continues_exactly(proc_engine: ProcessEngine) -> None:
    tok = proc_engine.tokenizer
    prompt = tok.encode("Once upon a time")
    proc_engine.add(EngineRequest("full", prompt, greedy(24)))
    full = (await collect(proc_engine, 1))["full"]
    for k in (1, 13, 24):
        proc_engine.add(
            EngineRequest(f"r{k}", prompt, greedy(24), resume_token_ids=full.token_ids[:k])
        )
        r = (await collect(proc_engine, 1))[f"r{k}"]
        assert full.token_ids[:k] + r.token_ids == full.token_ids
        assert r.finish is not None and r.finish.completion_tokens == 24


async def test_killed_child_fails_running_sequences_then_closes(
    kind: tuple[str, dict[str, Any]],
) -> None:
    name, options = kind
    eng = make_engine_in_process(name, **options)
    assert isinstance(eng, ProcessEngine)
    tok = eng.tokenizer
    eng.add(EngineRequest("early", tok.encode("added before start"), greedy(2000)))  # sent at start
    await eng.start()
    eng.add(EngineRequest("late", tok.encode("after start"), greedy(2000)))
    async with asyncio.timeout(30):
        while not any(o.token_ids for o in await eng.outputs()):
            pass
    assert eng.pid is not None
    os.kill(eng.pid, signal.SIGKILL)
    errors: dict[str, StepOutput] = {}
    async with asyncio.timeout(10):
        with pytest.raises(EngineClosed):
            while True:
                for out in await eng.outputs():
                    if out.finish_reason is not None:
                        errors[out.seq_id] = out
    assert set(errors) == {"early", "late"}
    for out in errors.values():
        assert out.finish_reason is FinishReason.ERROR
        assert out.error == "engine process died"
    assert eng.stats().running == 0
    with pytest.raises(EngineError, match="died"):
        eng.add(EngineRequest("after", tok.encode("x"), greedy(2)))
    async with asyncio.timeout(10):
        await eng.stop()
        with pytest.raises(EngineClosed):
            await eng.outputs()


async def test_stop_is_clean(kind: tuple[str, dict[str, Any]]) -> None:
    name, options = kind
    if name == "hf":
        pytest.skip("the module fixture's teardown stops an HF child; sim covers the details")
    eng = ProcessEngine(name, options)
    await eng.start()
    tok = eng.tokenizer
    eng.add(EngineRequest("running", tok.encode("hello"), greedy(4000)))
    async with asyncio.timeout(10):
        while not any(o.token_ids for o in await eng.outputs()):
            pass
    proc = eng._proc
    assert proc is not None
    async with asyncio.timeout(20):
        await eng.stop()
    assert not proc.is_alive() and proc.exitcode == 0  # exited by itself, not killed
    outs: list[StepOutput] = []
    with pytest.raises(EngineClosed):
        while True:
            outs += await eng.outputs()
    last = [o for o in outs if o.seq_id == "running"][-1]
    assert last.finish_reason is FinishReason.ERROR and last.error == "engine stopped"
    await eng.stop()  # idempotent
    with pytest.raises(EngineError, match="stopped"):
        eng.add(EngineRequest("x", tok.encode("x"), greedy(2)))


async def test_options_must_be_plain_data() -> None:
    with pytest.raises(TypeError, match="cannot be sent"):
        ProcessEngine("sim", {"sleep": lambda s: None})


async def test_decoding_features_cross_the_pipe(proc_engine: ProcessEngine) -> None:
    """The child's features are the parent's; a structured output the child cannot compile
    comes back as a refused ERROR (the job fails without a retry), and one it can runs."""
    if proc_engine.name != "hf":  # the sim's: test_the_childs_features_and_logprobs_cross_the_pipe
        assert proc_engine.limits().features == SimEngine.features
        return
    assert proc_engine.limits().features == frozenset(Feature)
    tok = proc_engine.tokenizer
    bad = SamplingParams(max_tokens=8, guide=Guide(regex="(unclosed"))
    proc_engine.add(EngineRequest("bad", tok.encode("hi"), bad))
    good = SamplingParams(max_tokens=8, temperature=1.0, seed=1, guide=Guide(choice=("yes", "no")))
    proc_engine.add(EngineRequest("good", tok.encode("hi"), good))
    res = await collect(proc_engine, 2)
    finish = res["bad"].finish
    assert finish is not None and finish.finish_reason is FinishReason.ERROR and finish.refused
    assert res["good"].text in ("yes", "no")


async def test_the_childs_features_and_logprobs_cross_the_pipe() -> None:
    assert ProcessEngine("sim", SIM).limits().features == SimEngine.features
    options = {**SIM, "logprobs": True}
    eng = ProcessEngine("sim", options)
    assert eng.limits().features == frozenset(Feature)
    local = make_engine("sim", **options)
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, logit_bias=((70, 3.0),))
    try:
        for engine in (eng, local):
            await engine.start()
            engine.add(EngineRequest("lp", eng.tokenizer.encode("hello"), params))
        got, want = await collect(eng, 1), await collect(local, 1)
        logprobs = [lp for o in got["lp"].outputs for lp in o.logprobs or ()]
        assert len(logprobs) == 6 and all(len(lp.top) == 2 for lp in logprobs)
        assert logprobs == [lp for o in want["lp"].outputs for lp in o.logprobs or ()]
    finally:
        await eng.stop()
        await local.stop()
