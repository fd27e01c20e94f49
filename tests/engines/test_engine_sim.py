"""SimEngine: cost model on an injected clock, a stepper within its capacity, failures, resume."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.engines.clock import VirtualClock
from tests.engines.outputs import collect, record_deliveries
from tokenyard.engines import EngineRequest, StepOutput, make_engine
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.errors import EngineClosed, EngineError, InvalidRequest
from tokenyard.messages import FinishReason, Priority, SamplingParams

A, B, C, D = 0.5, 0.01, 0.1, 0.02  # prefill a + b·tokens, decode c + d·batch


@pytest.fixture
async def clock_engine() -> AsyncIterator[tuple[SimEngine, VirtualClock]]:
    clock = VirtualClock()
    engine = SimEngine(
        prefill_base=A,
        prefill_per_token=B,
        decode_base=C,
        decode_per_seq=D,
        max_seqs=4,
        sleep=clock.sleep,
    )
    yield engine, clock
    await engine.stop()


GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


async def test_cost_model_on_virtual_clock(clock_engine: tuple[SimEngine, VirtualClock]) -> None:
    engine, clock = clock_engine
    # Added before start, so both start together in the first step.
    engine.add(EngineRequest("a", [5] * 10, SamplingParams(max_tokens=3, temperature=0.0)))
    engine.add(EngineRequest("b", [6] * 20, SamplingParams(max_tokens=5, temperature=0.0)))
    await engine.start()
    res = await collect(engine, 2)
    assert [len(res[k].token_ids) for k in "ab"] == [3, 5]
    expected = [A + B * 30, C + 2 * D, C + 2 * D, C + 2 * D, C + D, C + D]
    assert clock.sleeps == pytest.approx(expected)
    assert clock.time() == pytest.approx(sum(expected))
    stats = engine.stats()
    assert (stats.steps, stats.sequences_stepped, stats.tokens_generated) == (5, 8, 8)
    assert stats.mean_batch == pytest.approx(1.6)
    assert stats.running == 0


async def test_runs_what_it_is_given_and_refuses_beyond_capacity(
    clock_engine: tuple[SimEngine, VirtualClock],
) -> None:
    engine, _ = clock_engine
    await engine.start()
    for i in range(4):
        engine.add(EngineRequest(f"s{i}", [7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0)))
    with pytest.raises(EngineError, match="full"):
        engine.add(EngineRequest("s4", [7, 8, 9], SamplingParams(max_tokens=6, temperature=0.0)))
    assert engine.stats().running == 4
    res = await collect(engine, 4)
    for i in range(4):
        r = res[f"s{i}"]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
        assert len(r.token_ids) == r.finish.completion_tokens == 6
        assert r.finish.prompt_tokens == 3
    stats = engine.stats()
    assert stats.mean_batch == 4  # all four stepped together from the first step
    assert stats.running == 0 and stats.reserved_tokens == 0
    assert stats.prefill_tokens == 12
    room_again = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add(EngineRequest("s4", [7, 8, 9], room_again))
    assert (await collect(engine, 1))["s4"].finish is not None


async def test_token_budget_is_capacity_and_context() -> None:
    clock = VirtualClock()
    engine = SimEngine(max_seqs=8, max_tokens=30, sleep=clock.sleep)
    assert engine.limits().context == 30
    fifteen = SamplingParams(max_tokens=10, temperature=0.0)  # with the prompt: 15 tokens
    engine.add(EngineRequest("s0", [4] * 5, fifteen))
    engine.add(EngineRequest("s1", [4] * 5, SamplingParams(max_tokens=10, temperature=0.0)))
    with pytest.raises(EngineError, match="tokens"):
        engine.add(EngineRequest("s2", [4] * 5, SamplingParams(max_tokens=10, temperature=0.0)))
    assert engine.stats().reserved_tokens == 30
    # Longer than the whole budget: no engine of this size could ever run it.
    with pytest.raises(InvalidRequest) as refused:
        engine.add(EngineRequest("big", [4] * 25, SamplingParams(max_tokens=10)))
    assert refused.value.code == "context_length_exceeded"
    await engine.start()
    await collect(engine, 2)
    await engine.stop()


async def test_deterministic_tokens_and_exact_resume(
    clock_engine: tuple[SimEngine, VirtualClock],
) -> None:
    engine, _ = clock_engine
    await engine.start()
    prompt = engine.tokenizer.encode("resume me")
    sampled = SamplingParams(max_tokens=20, temperature=0.9, seed=11)
    engine.add(EngineRequest("g", prompt, GREEDY))
    engine.add(EngineRequest("s", prompt, sampled))
    full = await collect(engine, 2)
    assert full["g"].token_ids != full["s"].token_ids
    for k in (1, 7, 19):
        engine.add(EngineRequest(f"g{k}", prompt, GREEDY, resume_token_ids=full["g"].token_ids[:k]))
        engine.add(
            EngineRequest(f"s{k}", prompt, sampled, resume_token_ids=full["s"].token_ids[:k])
        )
        part = await collect(engine, 2)
        for name in ("g", "s"):
            r = part[f"{name}{k}"]
            assert full[name].token_ids[:k] + r.token_ids == full[name].token_ids
            assert full[name].text.endswith(r.text)
            assert r.finish is not None and r.finish.completion_tokens == 20


async def test_failure_marker_and_fail_rate() -> None:
    clock = VirtualClock()
    engine = SimEngine(sleep=clock.sleep, fail_marker="BOOM")
    await engine.start()
    tok = engine.tokenizer
    engine.add(EngineRequest("bad", tok.encode("please BOOM now"), GREEDY))
    engine.add(EngineRequest("good", tok.encode("fine"), GREEDY))
    res = await collect(engine, 2)
    bad = res["bad"].finish
    assert bad is not None and bad.finish_reason is FinishReason.ERROR
    assert bad.error is not None and "BOOM" in bad.error
    assert res["good"].finish is not None
    assert res["good"].finish.finish_reason is FinishReason.LENGTH
    await engine.stop()

    outcomes = []
    for _ in range(2):  # a seeded RNG: the same failures twice
        engine = SimEngine(sleep=VirtualClock().sleep, fail_rate=0.05, seed=3)
        for i in range(8):
            engine.add(EngineRequest(f"s{i}", [9, 9], GREEDY))
        await engine.start()
        res = await collect(engine, 8)
        outcomes.append({k: r.finish.finish_reason for k, r in res.items() if r.finish})
        await engine.stop()
    assert outcomes[0] == outcomes[1]
    assert FinishReason.ERROR in outcomes[0].values()
    assert FinishReason.LENGTH in outcomes[0].values()


async def test_abort_frees_slot() -> None:
    clock = VirtualClock()
    engine = SimEngine(max_seqs=1, sleep=clock.sleep)
    await engine.start()
    engine.add(EngineRequest("long", [5], SamplingParams(max_tokens=3000, temperature=0.0)))
    with pytest.raises(EngineError):
        engine.add(EngineRequest("short", [6], SamplingParams(max_tokens=2, temperature=0.0)))
    first = await engine.outputs()
    # one step's output or more (the engine may step again before this task reads): all "long"
    assert {o.seq_id for o in first} == {"long"}
    assert engine.stats().running == 1
    engine.abort("long")
    engine.abort("nobody")  # unknown ids are ignored
    assert engine.stats().running == 0
    engine.add(EngineRequest("short", [6], SamplingParams(max_tokens=2, temperature=0.0)))
    res = await collect(engine, 2)
    assert res["long"].finish is not None
    assert res["long"].finish.finish_reason is FinishReason.CANCELLED
    assert res["short"].finish is not None
    assert res["short"].finish.finish_reason is FinishReason.LENGTH
    await engine.stop()


async def test_stop_strings_and_eos() -> None:
    clock = VirtualClock()
    engine = SimEngine(sleep=clock.sleep)
    await engine.start()
    prompt = engine.tokenizer.encode("tell me")
    engine.add(EngineRequest("full", prompt, SamplingParams(max_tokens=40, temperature=0.0)))
    text = (await collect(engine, 1))["full"].text
    stop = text[12:15]
    engine.add(
        EngineRequest(
            "stopped", prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=(stop,))
        )
    )
    r = (await collect(engine, 1))["stopped"]
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    assert r.text == text[: text.find(stop)]
    await engine.stop()

    engine = SimEngine(sleep=VirtualClock().sleep, eos_rate=0.3)
    await engine.start()
    engine.add(EngineRequest("eos", prompt, SamplingParams(max_tokens=200, temperature=0.0)))
    engine.add(
        EngineRequest(
            "no-eos", prompt, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        )
    )
    res = await collect(engine, 2)
    eos = res["eos"]
    assert eos.finish is not None and eos.finish.finish_reason is FinishReason.STOP
    assert eos.token_ids[-1] == SimTokenizer.EOS
    assert res["no-eos"].finish is not None
    assert res["no-eos"].finish.completion_tokens == 50
    await engine.stop()


async def test_real_time_default_sleep() -> None:
    engine = make_engine("sim", decode_base=0.002, decode_per_seq=0.0, prefill_base=0.0)
    assert isinstance(engine, SimEngine)
    await engine.start()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    engine.add(EngineRequest("x", [4, 5], SamplingParams(max_tokens=10)))
    await collect(engine, 1)
    assert loop.time() - t0 >= 0.018
    await engine.stop()


async def test_stop_fails_running_and_closes() -> None:
    # Real (short) sleeps: "a" needs thousands of steps, so it is surely running at stop().
    engine = SimEngine(max_seqs=2, decode_base=0.002, prefill_base=0.0)
    await engine.start()
    engine.add(EngineRequest("a", [5], SamplingParams(max_tokens=4000, temperature=0.0)))
    engine.add(EngineRequest("b", [5], SamplingParams(max_tokens=4000, temperature=0.0)))
    await engine.outputs()
    await engine.stop()
    seen: dict[str, StepOutput] = {}
    with pytest.raises(EngineClosed):
        while True:
            for out in await engine.outputs():
                if out.finish_reason is not None:
                    seen[out.seq_id] = out
    assert {k: v.error for k, v in seen.items()} == {"a": "engine stopped", "b": "engine stopped"}
    with pytest.raises(EngineClosed):
        await engine.outputs()
    with pytest.raises(EngineError, match="stopped"):
        engine.add(EngineRequest("late", [5], GREEDY))


async def test_request_validation_and_already_complete_resume() -> None:
    engine = SimEngine(sleep=VirtualClock().sleep, max_model_len=64, max_seqs=1)
    with pytest.raises(InvalidRequest):
        engine.add(EngineRequest("empty", [], GREEDY))
    with pytest.raises(InvalidRequest) as refused:
        engine.add(EngineRequest("long", [4] * 50, GREEDY))  # 50 + 20 > 64
    assert refused.value.code == "context_length_exceeded"
    assert "maximum context length is 64" in refused.value.message
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.add(EngineRequest("hot", [4], SamplingParams(max_tokens=2, temperature=-1.0)))
    engine.add(EngineRequest("dup", [4], GREEDY))
    with pytest.raises(EngineError, match="already"):
        engine.add(EngineRequest("dup", [4], GREEDY))
    # Resumed tokens that already reach max_tokens finish at once, even before start, and
    # take no capacity (the one slot is held by "dup").
    engine.add(EngineRequest("done", [4], SamplingParams(max_tokens=2), resume_token_ids=[70, 71]))
    await engine.start()
    res = await collect(engine, 2)
    assert res["done"].finish is not None
    assert res["done"].finish.finish_reason is FinishReason.LENGTH
    assert res["done"].finish.completion_tokens == 2 and res["done"].token_ids == []
    await engine.stop()


def test_sim_tokenizer_roundtrip_and_factory() -> None:
    tok = SimTokenizer()
    text = "héllo 🚀"
    assert tok.decode(tok.encode(text)) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.endswith("<assistant>") and "hi" in chat
    assert tok.eos_token_id == SimTokenizer.EOS
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("nope")


async def test_an_alone_sequence_takes_its_first_step_without_the_others(
    clock_engine: tuple[SimEngine, VirtualClock],
) -> None:
    engine, clock = clock_engine
    steps = record_deliveries(engine)
    await engine.start()
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    for name in "abc":
        engine.add(EngineRequest(name, [5] * 10, long))
    async with asyncio.timeout(30):
        while not any(out.token_ids for step in steps for out in step):
            await asyncio.sleep(0.001)  # the three decode
    engine.add(EngineRequest("h", [6] * 20, GREEDY, alone=True))
    res = await collect(engine, 4)
    first = next(i for i, step in enumerate(steps) if any(o.seq_id == "h" for o in step))
    assert [o.seq_id for o in steps[first]] == ["h"]  # the others waited that one step
    assert {o.seq_id for o in steps[first + 1]} == {"a", "b", "c", "h"}  # then all resume
    # its step cost a prefill and a decode of one: the batch's decode is not in it
    at = clock.sleeps.index(pytest.approx(A + B * 20))
    assert clock.sleeps[at + 1] == pytest.approx(C + D)
    assert [len(res[k].token_ids) for k in "abch"] == [200, 200, 200, 20]


async def test_a_prefill_cap_splits_long_prompts_over_steps_the_others_decode_in(
    clock_engine: tuple[SimEngine, VirtualClock],
) -> None:
    engine, clock = clock_engine
    steps = record_deliveries(engine)
    engine.add(EngineRequest("a", [5] * 10, SamplingParams(max_tokens=12, temperature=0.0)))
    await engine.start()
    async with asyncio.timeout(30):
        while not steps:
            await asyncio.sleep(0.001)  # a decodes
    engine.cap_prefill(40)
    engine.add(EngineRequest("b", [6] * 100, GREEDY))  # 40 + 40 + 20 tokens: three steps
    res = await collect(engine, 2)
    # each of b's chunks is a prefill of at most 40 tokens beside a's decode of one
    chunks = [s for s in clock.sleeps if s > C + 2 * D + 1e-9]
    assert chunks == pytest.approx([A + B * 10, A + B * 40, A + B * 40, A + B * 20])
    # b's first token came in the step its last chunk went in, not before
    first = next(i for i, step in enumerate(steps) if any(o.seq_id == "b" for o in step))
    assert sum(1 for step in steps[:first] if any(o.seq_id == "a" for o in step)) >= 3
    # the same tokens as its prompt prefilled whole
    whole = SimEngine(max_seqs=4, sleep=VirtualClock().sleep)
    whole.add(EngineRequest("b", [6] * 100, GREEDY))
    await whole.start()
    try:
        assert (await collect(whole, 1))["b"].token_ids == res["b"].token_ids
    finally:
        await whole.stop()
    assert len(res["b"].token_ids) == 20 and engine.stats().prefill_tokens == 110
    engine.cap_prefill(None)  # off: a prompt's prefill is one step again
    engine.add(EngineRequest("c", [7] * 100, SamplingParams(max_tokens=2, temperature=0.0)))
    await collect(engine, 1)
    assert clock.sleeps[-3] == pytest.approx(A + B * 100)


async def test_under_a_prefill_cap_a_higher_priority_prompt_is_prefilled_first(
    clock_engine: tuple[SimEngine, VirtualClock],
) -> None:
    engine, clock = clock_engine
    steps = record_deliveries(engine)
    engine.cap_prefill(40)
    engine.add(EngineRequest("b", [6] * 100, GREEDY, priority=Priority.BATCH))
    engine.add(EngineRequest("h", [7] * 30, GREEDY, priority=Priority.HIGH))  # added after b
    await engine.start()
    res = await collect(engine, 2)
    # h's 30 tokens and 10 of b's in the first step: h decodes from it, b two steps later
    assert [o.seq_id for o in steps[0]] == ["h"]
    assert clock.sleeps[:2] == pytest.approx([A + B * 40, C + D])
    assert len(res["b"].token_ids) == len(res["h"].token_ids) == 20
