"""HF engines on the tiny model: real forward passes, continuous and static batching."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch
from transformers import AutoConfig

from tests.engines.outputs import collect, record_deliveries
from tokenyard.engines import EngineCapacity, EngineRequest, StepOutput, make_engine
from tokenyard.engines.hf import HFEngine, kv_bytes_per_token, plan_capacity
from tokenyard.engines.hf_static import HFStaticEngine
from tokenyard.engines.sampling import add_gumbel_noise, apply_temperature, apply_top_k_top_p
from tokenyard.errors import EngineClosed, EngineError, InvalidRequest
from tokenyard.messages import FinishReason, Priority, SamplingParams

PROMPTS = [
    "The queue holds",
    "Once upon a time there was",
    "def add(a, b):",
    "Le café",
    "Привет",
    "0 1 2 3 4 5 6 7",
]


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def reference(engine: HFEngine | HFStaticEngine, prompt: list[int], n: int) -> list[int]:
    """Plain model.generate greedy continuation, EOS ignored."""
    assert engine.model is not None
    with torch.inference_mode():
        out = engine.model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


@pytest.fixture
async def engine(tiny_model_path: Path) -> AsyncIterator[HFEngine]:
    eng = HFEngine(str(tiny_model_path), max_seqs=32, max_tokens=16384, threads=1)
    await eng.start()
    yield eng
    await eng.stop()


async def test_greedy_matches_model_generate(engine: HFEngine) -> None:
    tok = engine.tokenizer
    for i, p in enumerate(PROMPTS):
        engine.add(EngineRequest(f"s{i}", tok.encode(p), greedy(24)))
    res = await collect(engine, len(PROMPTS))
    for i, p in enumerate(PROMPTS):
        r = res[f"s{i}"]
        ref = reference(engine, tok.encode(p), 24)
        assert r.token_ids == ref
        assert r.text == tok.decode(ref)
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
        assert r.finish.completion_tokens == 24
        assert r.finish.prompt_tokens == len(tok.encode(p))


async def test_many_concurrent_sequences_are_batched(engine: HFEngine) -> None:
    tok = engine.tokenizer
    n = 24
    for i in range(n):
        engine.add(EngineRequest(f"c{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), greedy(8 + i)))
    res = await collect(engine, n)
    for i in range(n):
        r = res[f"c{i}"]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
        assert len(r.token_ids) == r.finish.completion_tokens == 8 + i
        # Streaming is per step, one token each; counts only ever grow.
        counts = [o.completion_tokens for o in r.outputs]
        assert counts == sorted(counts)
    stats = engine.stats()
    assert stats.tokens_generated == sum(8 + i for i in range(n))
    assert stats.mean_batch > 4
    assert stats.running == 0


async def test_runs_max_seqs_in_one_step_and_refuses_more(tiny_model_path: Path) -> None:
    eng = HFEngine(str(tiny_model_path), threads=1)  # the CPU default: 64 sequences
    n = eng.capacity.max_seqs
    assert n == 64
    await eng.start()
    tok = eng.tokenizer
    for i in range(n):
        eng.add(EngineRequest(f"m{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), greedy(32)))
    with pytest.raises(EngineError, match="full"):
        eng.add(EngineRequest("one-more", tok.encode("one too many"), greedy(4)))
    assert eng.stats().running == n
    res = await collect(eng, n)
    assert all(len(r.token_ids) == 32 for r in res.values())
    stats = eng.stats()
    # Every sequence decodes in every step once started; only the adds racing the manager's
    # first step or two can make a step smaller.
    assert stats.mean_batch >= 0.9 * n
    assert stats.running == 0 and stats.reserved_tokens == 0 and stats.waiting == 0
    assert 0 <= stats.kv_cache_usage < 0.05
    assert eng._warm.is_set()  # the warm-up request ran before start() returned
    await eng.stop()


async def test_kv_usage_counts_only_the_blocks_sequences_hold(tiny_model_path: Path) -> None:
    # full blocks of finished prompts stay cached for prefix reuse, free for any new sequence:
    # an idle engine read them as in use (0.40 here, 0.61-0.83 on a GPU)
    eng = HFEngine(str(tiny_model_path), max_seqs=8, max_tokens=8192, threads=1)
    await eng.start()
    tok = eng.tokenizer
    text = " ".join(f"word{i}" for i in range(150))
    for i in range(6):
        eng.add(EngineRequest(f"k{i}", tok.encode(f"{i} {text}"), greedy(40)))
    # running: their blocks are held (sampled while they run: 40 tokens take a tiny model
    # well under a second)
    collected = asyncio.create_task(collect(eng, 6))
    seen = 0.0
    while not collected.done():
        seen = max(seen, eng.stats().kv_cache_usage)
        await asyncio.sleep(0.005)
    await collected
    assert seen > 0.05
    cache = eng._manager.batch_processor.cache  # type: ignore[union-attr]
    assert sum(len(a.ledger.cached_blocks) for a in cache.cache_allocators.values()) > 0
    assert eng.stats().kv_cache_usage == 0.0
    await eng.stop()


async def test_a_reused_prefix_is_reported_as_cached_tokens(engine: HFEngine) -> None:
    # transformers' prefix sharing: the second prompt's leading full pages are the first's
    tok = engine.tokenizer
    text = " ".join(f"word{i}" for i in range(120))
    first, second = tok.encode(text + " one"), tok.encode(text + " two")
    before = engine.stats()
    engine.add(EngineRequest("c1", first, greedy(2)))
    done = await collect(engine, 1)
    assert done["c1"].finish is not None and done["c1"].finish.cached_tokens == 0
    engine.add(EngineRequest("c2", second, greedy(2)))
    done = await collect(engine, 1)
    end = done["c2"].finish
    assert end is not None and end.cached_tokens is not None
    # whole pages of the shared text, never the whole prompt (one token is always prefilled)
    assert 0 < end.cached_tokens < len(second)
    assert end.cached_tokens % engine.page_size == 0
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert end.cached_tokens <= shared
    stats = engine.stats()
    assert stats.prefix_cache_queries - before.prefix_cache_queries == len(first) + len(second)
    assert stats.prefix_cache_hits - before.prefix_cache_hits == end.cached_tokens


async def test_refusals(engine: HFEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("hello")
    context = engine.tokenizer.max_model_len
    with pytest.raises(InvalidRequest) as refused:
        engine.add(EngineRequest("long", prompt, greedy(context - len(prompt) + 1)))
    assert refused.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequest):
        engine.add(EngineRequest("empty", [], greedy(4)))
    # The whole context fits; the same seq_id twice is the caller's bug.
    engine.add(EngineRequest("a", prompt, greedy(context - len(prompt))))
    with pytest.raises(EngineError, match="already"):
        engine.add(EngineRequest("a", prompt, greedy(3)))
    assert engine.stats().reserved_tokens == context
    engine.abort("a")
    assert engine.stats().reserved_tokens == 0
    await collect(engine, 1)


async def test_abort_frees_a_slot(tiny_model_path: Path) -> None:
    eng = HFEngine(str(tiny_model_path), max_seqs=2, max_tokens=8192, threads=1)
    await eng.start()
    tok = eng.tokenizer
    prompt = tok.encode("long story")
    eng.add(EngineRequest("a", prompt, greedy(1500)))
    eng.add(EngineRequest("b", prompt, greedy(1500)))
    with pytest.raises(EngineError):
        eng.add(EngineRequest("c", prompt, greedy(5)))  # no slot: the scheduler must not have asked
    first = await eng.outputs()
    assert {o.seq_id for o in first} <= {"a", "b"}
    assert eng.stats().running == 2
    eng.abort("a")
    assert eng.stats().running == 1
    eng.add(EngineRequest("c", prompt, greedy(5)))  # the slot is free at once
    res: dict[str, list[StepOutput]] = {}
    async with asyncio.timeout(30):
        while not any(o.finish_reason for o in res.get("c", [])):
            for out in await eng.outputs():
                res.setdefault(out.seq_id, []).append(out)
    assert res["a"][-1].finish_reason is FinishReason.CANCELLED
    assert all(o.finish_reason is None for o in res["b"])  # still running when "c" is done
    assert sum(len(o.token_ids) for o in res["c"]) == 5
    eng.abort("b")
    async with asyncio.timeout(30):
        while True:
            outs = await eng.outputs()
            if any(o.seq_id == "b" and o.finish_reason for o in outs):
                break
    assert eng.stats().running == 0
    await eng.stop()


async def test_a_higher_priority_prompt_is_prefilled_before_waiting_lower_ones(
    tiny_model_path: Path,
) -> None:
    # 32 tokens a step: eight 60-token prompts take 15 steps to prefill; transformers alone
    # prefills in arrival order, so the high one, added last, would start last
    eng = HFEngine(
        str(tiny_model_path), max_seqs=16, max_tokens=16384, max_batch_tokens=32, threads=1
    )
    await eng.start()
    try:
        tok = eng.tokenizer
        words = " ".join(["queue"] * 60)
        for i in range(8):
            prompt = tok.encode(f"{i} {words}")[:60]
            eng.add(EngineRequest(f"n{i}", prompt, greedy(2), priority=Priority.NORMAL))
        high = tok.encode(f"urgent {words}")[:60]
        eng.add(EngineRequest("h", high, greedy(2), priority=Priority.HIGH))
        first: list[str] = []
        async with asyncio.timeout(60):
            while len(first) < 9:
                for out in await eng.outputs():
                    if out.token_ids and out.seq_id not in first:
                        first.append(out.seq_id)
        # the manager may have begun a prompt or two before "h" reached it, none more
        assert first.index("h") <= 2, first
        assert [s for s in first if s != "h"] == [f"n{i}" for i in range(8)]  # arrival order
    finally:
        await eng.stop()


async def test_an_alone_sequence_takes_its_first_pass_without_the_running_ones(
    engine: HFEngine,
) -> None:
    tok = engine.tokenizer
    passes = record_deliveries(engine)
    for i in range(3):
        engine.add(EngineRequest(f"r{i}", tok.encode(PROMPTS[i]), greedy(40)))
    async with asyncio.timeout(60):
        while len({o.seq_id for p in passes for o in p if o.token_ids}) < 3:
            await asyncio.sleep(0.005)  # the three decode
    high = tok.encode(PROMPTS[3])
    engine.add(EngineRequest("h", high, greedy(6), priority=Priority.HIGH, alone=True))
    res = await collect(engine, 4)
    first = next(i for i, p in enumerate(passes) if any(o.seq_id == "h" for o in p))
    assert [o.seq_id for o in passes[first]] == ["h"]  # the running ones sat that pass out
    assert {o.seq_id for o in passes[first + 1]} == {"r0", "r1", "r2", "h"}  # then all go on
    assert res["h"].token_ids == reference(engine, high, 6)
    for i in range(3):  # and theirs are as if nothing happened
        assert res[f"r{i}"].token_ids == reference(engine, tok.encode(PROMPTS[i]), 40)


@pytest.mark.parametrize(
    "params",
    [greedy(30), SamplingParams(max_tokens=30, temperature=0.8, top_k=40, top_p=0.9, seed=5)],
    ids=["greedy", "seeded-sampling"],
)
async def test_resume_continues_exactly(engine: HFEngine, params: SamplingParams) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("Once upon a time")
    engine.add(EngineRequest("full", prompt, params))
    full = (await collect(engine, 1))["full"]
    assert len(full.token_ids) == 30
    for k in (1, 11, 29):
        # Text the first attempt had streamed after k tokens (one token per step here).
        streamed = "".join(o.text for o in full.outputs[:k])
        assert sum(len(o.token_ids) for o in full.outputs[:k]) == k
        engine.add(EngineRequest(f"r{k}", prompt, params, resume_token_ids=full.token_ids[:k]))
        r = (await collect(engine, 1))[f"r{k}"]
        assert full.token_ids[:k] + r.token_ids == full.token_ids
        assert streamed + r.text == full.text
        assert r.finish is not None and r.finish.completion_tokens == 30


async def test_seeded_sampling_is_reproducible_and_varies(engine: HFEngine) -> None:
    prompt = engine.tokenizer.encode("The queue holds")
    for i, seed in enumerate([1, 1, 2]):
        engine.add(
            EngineRequest(
                f"x{i}", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=seed)
            )
        )
    res = await collect(engine, 3)
    assert res["x0"].token_ids == res["x1"].token_ids
    assert res["x0"].token_ids != res["x2"].token_ids


async def test_stop_string_is_not_emitted(engine: HFEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("def add(a, b):")
    engine.add(EngineRequest("full", prompt, greedy(40)))
    text = (await collect(engine, 1))["full"].text
    start = next(i for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    stop = text[start : start + 3]
    engine.add(EngineRequest("stopped", prompt, greedy(40, stop=(stop, "never-appears"))))
    r = (await collect(engine, 1))["stopped"]
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    assert r.text == text[: text.find(stop)]
    assert r.finish.completion_tokens < 40
    assert engine.stats().running == 0


async def test_eos_stops_unless_ignored(engine: HFEngine) -> None:
    tok = engine.tokenizer
    prompt = tok.encode("Le café")
    ref = reference(engine, prompt, 12)
    pos = next(i for i in range(3, 12) if ref[i] not in ref[:i])
    # Make the token greedy emits at `pos` the EOS, for both the manager and the decoder.
    tok.eos_token_ids = frozenset({ref[pos]})
    engine.add(EngineRequest("eos", prompt, SamplingParams(max_tokens=12, temperature=0.0)))
    engine.add(EngineRequest("ignore", prompt, greedy(12)))
    res = await collect(engine, 2)
    assert res["eos"].token_ids == ref[: pos + 1]
    assert res["eos"].finish is not None and res["eos"].finish.finish_reason is FinishReason.STOP
    assert res["ignore"].token_ids == ref


async def test_add_before_start_and_stop_closes(tiny_model_path: Path) -> None:
    eng = make_engine("hf", model=str(tiny_model_path), max_seqs=4, max_tokens=4096, threads=1)
    assert isinstance(eng, HFEngine)
    prompt = eng.tokenizer.encode("hello")
    eng.add(EngineRequest("early", prompt, greedy(3)))
    eng.add(EngineRequest("forever", prompt, greedy(2000)))
    await eng.start()
    res = await collect(eng, 1)
    assert res["early"].finish is not None
    await eng.stop()
    finals: dict[str, StepOutput] = {}
    with pytest.raises(EngineClosed):
        while True:
            for out in await eng.outputs():
                if out.finish_reason is not None:
                    finals[out.seq_id] = out
    assert finals["forever"].finish_reason is FinishReason.ERROR
    with pytest.raises(EngineError, match="stopped"):
        eng.add(EngineRequest("late", prompt, greedy(3)))


async def test_static_micro_batches(tiny_model_path: Path) -> None:
    eng = make_engine(
        "hf-static", model=str(tiny_model_path), batch_size=4, batch_timeout_ms=50, threads=1
    )
    assert isinstance(eng, HFStaticEngine) and eng.capacity.max_seqs == 8
    await eng.start()
    tok = eng.tokenizer
    for i in range(8):  # two batches' worth: its capacity
        eng.add(EngineRequest(f"s{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), greedy(6 + i)))
    with pytest.raises(EngineError):
        eng.add(EngineRequest("s8", tok.encode(PROMPTS[0]), greedy(6)))
    res = await collect(eng, 8)
    for i in (8, 9):
        eng.add(EngineRequest(f"s{i}", tok.encode(PROMPTS[i % len(PROMPTS)]), greedy(6 + i)))
    res |= await collect(eng, 2)
    for i in range(10):
        r = res[f"s{i}"]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
        assert len(r.token_ids) == r.finish.completion_tokens == 6 + i
    # Left padding must not change greedy results.
    for i in range(len(PROMPTS)):
        ids = tok.encode(PROMPTS[i])
        assert res[f"s{i}"].token_ids == reference(eng, ids, 6 + i)
    stats = eng.stats()
    assert stats.mean_batch > 1
    # A lone request runs once the window expires, as a batch of one.
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    eng.add(EngineRequest("alone", tok.encode("hi"), greedy(2, stop=("zzz",))))
    eng.add(EngineRequest("gone", tok.encode("hi"), greedy(2)))
    eng.abort("gone")
    res = await collect(eng, 2)
    assert loop.time() - t0 >= 0.04
    assert res["gone"].finish is not None
    assert res["gone"].finish.finish_reason is FinishReason.CANCELLED
    assert res["alone"].finish is not None and len(res["alone"].token_ids) == 2
    await eng.stop()


async def test_static_and_continuous_sample_the_same(
    engine: HFEngine, tiny_model_path: Path
) -> None:
    static = HFStaticEngine(str(tiny_model_path), batch_size=2, batch_timeout_ms=5, threads=1)
    await static.start()
    prompt = engine.tokenizer.encode("Pack my box")
    params = SamplingParams(max_tokens=12, temperature=0.7, top_p=0.95, seed=42, ignore_eos=True)
    engine.add(EngineRequest("x", prompt, params))
    static.add(EngineRequest("x", prompt, params))
    a = (await collect(engine, 1))["x"]
    b = (await collect(static, 1))["x"]
    assert a.token_ids == b.token_ids
    await static.stop()


def test_sampling_ops() -> None:
    scores = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.1, 0.2, 0.3]])
    greedy_rows = apply_temperature(scores, torch.tensor([0.0, 2.0]))
    assert greedy_rows[0].argmax() == 1 and torch.isinf(greedy_rows[0]).sum() == 3
    assert torch.allclose(greedy_rows[1], scores[1] / 2)
    top2 = apply_top_k_top_p(scores, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isinf(top2[0]).tolist() == [True, False, False, True]
    assert not torch.isinf(top2[1]).any()
    none = torch.tensor([0])
    nucleus = apply_top_k_top_p(torch.tensor([[10.0, 0.0, -10.0]]), none, torch.tensor([0.5]))
    assert torch.isinf(nucleus).tolist() == [[False, True, True]]
    # top-k first, then the nucleus of what is left: [3, 2] keep 0.73 and 0.27 of the mass.
    both = apply_top_k_top_p(scores[:1], torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isinf(both).tolist() == [[True, False, True, True]]
    # Gumbel-max sampling follows softmax: frequencies over many keys match probabilities.
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1])).expand(20000, 3)
    picks = add_gumbel_noise(logits, torch.arange(20000)).argmax(-1)
    freq = torch.bincount(picks, minlength=3).float() / 20000
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.02)
    # Negative keys mean greedy: no noise.
    assert torch.equal(add_gumbel_noise(scores, torch.tensor([-1, -1])), scores)


async def test_static_stop_ends_running_batch(tiny_model_path: Path) -> None:
    eng = HFStaticEngine(str(tiny_model_path), batch_size=2, batch_timeout_ms=1, threads=1)
    await eng.start()
    eng.add(EngineRequest("long", eng.tokenizer.encode("hello"), greedy(2000)))
    first = await eng.outputs()
    assert first[0].seq_id == "long" and first[0].finish_reason is None
    await asyncio.wait_for(eng.stop(), timeout=10)
    finals = []
    with pytest.raises(EngineClosed):
        while True:
            finals += [o for o in await eng.outputs() if o.finish_reason is not None]
    assert [(o.seq_id, o.finish_reason, o.error) for o in finals] == [
        ("long", FinishReason.ERROR, "engine stopped")
    ]


async def test_bf16_runs(tiny_model_path: Path) -> None:
    eng = HFEngine(str(tiny_model_path), dtype="bf16", max_seqs=4, max_tokens=2048, threads=1)
    await eng.start()
    for i in range(3):
        eng.add(EngineRequest(f"b{i}", eng.tokenizer.encode(PROMPTS[i]), greedy(10)))
    res = await collect(eng, 3)
    assert all(len(r.token_ids) == 10 for r in res.values())
    await eng.stop()
    with pytest.raises(ValueError, match="dtype"):
        HFEngine(str(tiny_model_path), dtype="int3")


def test_capacity_from_the_kv_cache(tiny_model_path: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_path)
    # 2 layers x (K, V) x 2 kv heads x head_dim 16 x 4 bytes
    assert kv_bytes_per_token(config, torch.float32) == 512
    assert kv_bytes_per_token(config, torch.bfloat16) == 256
    plan = {"page_size": 64, "max_model_len": 2048, "default_seqs": 64}
    # A roomy cache: the defaults, every sequence allowed the whole context.
    roomy = plan_capacity(kv_tokens=1 << 24, max_seqs=None, max_tokens=None, **plan)  # type: ignore[arg-type]
    assert roomy == EngineCapacity(64, 64 * 2048)
    # A small cache bounds both: a page per sequence is set aside for its partial page.
    small = plan_capacity(kv_tokens=64 * 100, max_seqs=None, max_tokens=None, **plan)  # type: ignore[arg-type]
    assert small == EngineCapacity(50, (100 - 50) * 64)
    asked = plan_capacity(kv_tokens=1 << 24, max_seqs=8, max_tokens=5000, **plan)  # type: ignore[arg-type]
    assert asked == EngineCapacity(8, 5000)
    # A cache sized for a budget and its sequences (the budget's pages + one per sequence, as
    # the engine sizes it on CUDA) holds all of them, also where they outnumber the budget's
    # pages (short sequences, large pages); without a budget asked for, half the pages at most.
    sized = plan_capacity(kv_tokens=(48 + 64) * 64, max_seqs=64, max_tokens=48 * 64, **plan)  # type: ignore[arg-type]
    assert sized == EngineCapacity(64, 48 * 64)
    unsized = plan_capacity(kv_tokens=(48 + 64) * 64, max_seqs=64, max_tokens=None, **plan)  # type: ignore[arg-type]
    assert unsized.max_seqs == 56
    # The tiny CPU model's defaults: 64 sequences, each may use the whole 2048-token context.
    eng = HFEngine(str(tiny_model_path))
    assert eng.capacity == EngineCapacity(64, 64 * 2048)
    assert eng.dtype == torch.float32 and eng.device.type == "cpu"
    assert eng.limits().max_model_len == 2048
