"""The hf engine's decoding features on the tiny model (real forward passes): penalties and
logit bias against their formulas, min_tokens, stop_token_ids, logprobs against a plain forward
pass, and structured outputs (xgrammar) for JSON schemas, regexes, choices and grammars."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

import jsonschema
import torch

from tests.engines.outputs import Result, collect
from tokenyard.engines import EngineRequest
from tokenyard.engines.hf import HFEngine, HFEngineBase
from tokenyard.engines.hf_static import HFStaticEngine
from tokenyard.engines.sampling import (
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
)
from tokenyard.errors import EngineError, InvalidRequest
from tokenyard.messages import Feature, FinishReason, Guide, SamplingParams

PROMPTS = ["The queue holds", "Once upon a time there was", "def add(a, b):", "0 1 2 3"]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
# every output of SCHEMA is at most ~110 characters, so fewer tokens: it always completes
SCHEMA_TOKENS = 160


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


@pytest.fixture(params=["hf", "hf-static"])
async def engine(
    tiny_model_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[HFEngineBase]:
    """Both transformers engines: continuous batching, and static batches (of 32 here)."""
    eng: HFEngineBase
    if request.param == "hf":
        eng = HFEngine(str(tiny_model_path), max_seqs=128, max_tokens=65536, threads=1)
    else:
        eng = HFStaticEngine(
            str(tiny_model_path),
            batch_size=32,
            batch_timeout_ms=5,
            max_seqs=128,
            max_tokens=65536,
            threads=1,
        )
    await eng.start()
    yield eng
    await eng.stop()


def forward_logits(engine: HFEngineBase, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The raw logits that predicted each output token: one plain forward pass (fp32)."""
    assert engine.model is not None
    model: torch.nn.Module = engine.model  # type: ignore[assignment]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)]


async def run_one(
    engine: HFEngineBase, prompt: list[int], params: SamplingParams, sid: str = "s"
) -> Result:
    engine.add(EngineRequest(sid, prompt, params))
    return (await collect(engine, 1))[sid]


def test_both_engines_declare_every_feature(tiny_model_path: Path) -> None:
    for eng in (
        HFEngine(str(tiny_model_path), max_seqs=4, max_tokens=4096, threads=1),
        HFStaticEngine(str(tiny_model_path), threads=1),
    ):
        assert eng.limits().features == frozenset(Feature)


@pytest.mark.parametrize(
    "kw",
    [
        {"repetition_penalty": 1.8},
        {"repetition_penalty": 0.6},
        {"frequency_penalty": 1.5},
        {"presence_penalty": 2.0},
        {"logit_bias": ((5, 4.0), (17, -100.0), (300, 2.5))},
        {
            "presence_penalty": 0.5,
            "frequency_penalty": 1.0,
            "repetition_penalty": 1.4,
            "logit_bias": ((9, 3.0),),
        },
    ],
    ids=["rep>1", "rep<1", "freq", "presence", "bias", "all"],
)
async def test_penalties_and_bias_follow_the_formulas(
    engine: HFEngineBase, kw: dict[str, object]
) -> None:
    """Each greedy token is the argmax of the raw logits of a plain forward pass adjusted by
    vLLM's formulas over the prompt and the tokens before it; and the output changed."""
    prompt = engine.tokenizer.encode(PROMPTS[3])
    plain = await run_one(engine, prompt, greedy(16), "plain")
    res = await run_one(engine, prompt, greedy(16, **kw))
    out = res.token_ids
    assert len(out) == 16 and out != plain.token_ids
    p = greedy(16, **kw)
    logits = forward_logits(engine, prompt, out)
    vocab = logits.size(-1)
    for i, tok in enumerate(out):
        row = logits[i : i + 1]
        bias = torch.zeros_like(row)
        for t, b in p.logit_bias:
            bias[0, t] = b
        row = apply_logit_bias(row, bias)
        seen = torch.zeros(1, vocab, dtype=torch.bool)
        seen[0, prompt + out[:i]] = True
        row = apply_repetition_penalty(row, seen, torch.tensor([p.repetition_penalty]))
        counts = torch.bincount(torch.tensor(out[:i], dtype=torch.long), minlength=vocab)
        row = apply_frequency_presence(
            row,
            counts.float().unsqueeze(0),
            torch.tensor([p.frequency_penalty]),
            torch.tensor([p.presence_penalty]),
        )
        assert int(row.argmax()) == tok, f"token {i}"


async def test_min_tokens_holds_back_eos_and_stop_token_ids(engine: HFEngineBase) -> None:
    tok = engine.tokenizer
    eos = min(tok.eos_token_ids)
    prompt = tok.encode(PROMPTS[0])
    # a bias that makes EOS the greedy choice at once: min_tokens alone delays it
    params = SamplingParams(
        max_tokens=20, temperature=0.0, min_tokens=6, logit_bias=((eos, 100.0),)
    )
    r = await run_one(engine, prompt, params, "eos")
    assert r.token_ids[-1] == eos and len(r.token_ids) == 7
    assert eos not in r.token_ids[:-1]
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    stop = 77
    params = greedy(20, min_tokens=3, stop_token_ids=(stop,), logit_bias=((stop, 100.0),))
    r = await run_one(engine, prompt, params, "stop")
    assert r.token_ids == [*r.token_ids[:3], stop] and stop not in r.token_ids[:3]
    assert r.text == tok.decode(r.token_ids[:3])
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP


async def test_stop_token_ids_end_with_stop(engine: HFEngineBase) -> None:
    tok = engine.tokenizer
    prompt = tok.encode(PROMPTS[1])
    ref = (await run_one(engine, prompt, greedy(24), "ref")).token_ids
    k = next(i for i in range(4, 24) if ref[i] not in ref[:i])
    r = await run_one(engine, prompt, greedy(24, stop_token_ids=(ref[k],)))
    assert r.token_ids == ref[: k + 1]  # the stop token is kept in the ids...
    assert r.text == tok.decode(ref[:k])  # ...not in the text
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    assert r.finish.completion_tokens == k + 1


async def test_greedy_logprobs_match_a_forward_pass(engine: HFEngineBase) -> None:
    tok = engine.tokenizer
    for i, p in enumerate(PROMPTS):
        engine.add(EngineRequest(f"g{i}", tok.encode(p), greedy(12, logprobs=5)))
    engine.add(EngineRequest("none", tok.encode(PROMPTS[0]), greedy(12, logprobs=0)))
    engine.add(EngineRequest("plain", tok.encode(PROMPTS[0]), greedy(12)))
    res = await collect(engine, len(PROMPTS) + 2)
    for i, p in enumerate(PROMPTS):
        r = res[f"g{i}"]
        lps = [lp for o in r.outputs for lp in (o.logprobs or [])]
        assert len(lps) == len(r.token_ids) == 12
        ref = forward_logits(engine, tok.encode(p), r.token_ids).log_softmax(-1)
        for j, (t, lp) in enumerate(zip(r.token_ids, lps, strict=True)):
            assert lp.token_id == t
            assert len(lp.top) == 5 and lp.top[0][0] == t  # greedy: the chosen is the top 1
            assert abs(lp.logprob - float(ref[j, t])) < 1e-4
            want = ref[j].topk(5)
            assert [x for x, _ in lp.top] == want.indices.tolist()
            for (_, v), w in zip(lp.top, want.values.tolist(), strict=True):
                assert abs(v - w) < 1e-4
    none = [lp for o in res["none"].outputs for lp in (o.logprobs or [])]
    assert len(none) == 12 and all(lp.top == () for lp in none)
    assert all(o.logprobs is None for o in res["plain"].outputs)
    assert res["plain"].token_ids == res["none"].token_ids


async def test_sampled_logprobs_are_raw_and_of_the_chosen_token(engine: HFEngineBase) -> None:
    prompt = engine.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(max_tokens=12, temperature=1.5, seed=3, ignore_eos=True, logprobs=2)
    params_pen = SamplingParams(
        max_tokens=12, temperature=1.5, seed=3, ignore_eos=True, logprobs=2, frequency_penalty=2
    )
    for sid, p in (("t", params), ("pen", params_pen)):
        r = await run_one(engine, prompt, p, sid)
        lps = [lp for o in r.outputs for lp in (o.logprobs or [])]
        ref = forward_logits(engine, prompt, r.token_ids).log_softmax(-1)
        for j, lp in enumerate(lps):
            assert lp.token_id == r.token_ids[j]
            assert abs(lp.logprob - float(ref[j, lp.token_id])) < 1e-4  # before penalties
            assert len(lp.top) == 2


# --------------------------------------------------------------------------------------------
# Structured outputs
# --------------------------------------------------------------------------------------------


def sampled(seed: int, guide: Guide, max_tokens: int = SCHEMA_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, guide=guide)


async def test_json_schema_outputs_validate_100_of_100(engine: HFEngineBase) -> None:
    guide = Guide(json=json.dumps(SCHEMA))
    tok = engine.tokenizer
    n = 100
    for i in range(n):
        engine.add(EngineRequest(f"j{i}", tok.encode(PROMPTS[i % 4]), sampled(i, guide)))
    res = await collect(engine, n, timeout=300)
    texts = set()
    for i in range(n):
        r = res[f"j{i}"]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP, r.text
        jsonschema.validate(json.loads(r.text), SCHEMA)
        texts.add(r.text)
    assert len(texts) > n // 2  # sampled: the seeds give different objects


async def test_regex_choice_grammar_and_json_object(engine: HFEngineBase) -> None:
    tok = engine.tokenizer
    prompt = tok.encode(PROMPTS[0])
    guides = {
        "regex": Guide(regex=r"[a-c]{2,5}-[0-9]{3}"),
        "choice": Guide(choice=("yes", "no", 'it "depends"')),
        "grammar": Guide(grammar='root ::= "(" ("x" | "y")+ ")"'),
        "object": Guide(json_object=True),
    }
    for i in range(8):
        for name, g in guides.items():
            limit = 60 if name == "object" else SCHEMA_TOKENS
            engine.add(EngineRequest(f"{name}{i}", prompt, sampled(i, g, limit)))
    res = await collect(engine, 8 * len(guides), timeout=300)
    for i in range(8):
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", res[f"regex{i}"].text)
        assert res[f"choice{i}"].text in ("yes", "no", 'it "depends"')
        assert re.fullmatch(r"\([xy]+\)", res[f"grammar{i}"].text) or (
            res[f"grammar{i}"].finish is not None
            and res[f"grammar{i}"].finish.finish_reason is FinishReason.LENGTH
        )
        obj = res[f"object{i}"]
        assert obj.finish is not None
        if obj.finish.finish_reason is FinishReason.STOP:  # `{}` nests: it may run out
            assert isinstance(json.loads(obj.text), dict)
        else:
            assert obj.text.startswith("{")


async def test_resumed_constrained_sequence_continues_and_validates(engine: HFEngineBase) -> None:
    tok = engine.tokenizer
    prompt = tok.encode(PROMPTS[1])
    params = sampled(7, Guide(json=json.dumps(SCHEMA)))
    full = await run_one(engine, prompt, params, "full")
    k = len(full.token_ids) // 2
    engine.add(EngineRequest("again", prompt, params, resume_token_ids=full.token_ids[:k]))
    rest = (await collect(engine, 1))["again"]
    # seeded sampling keyed by position, and the matcher replayed the prefix: the same output
    assert full.token_ids[:k] + rest.token_ids == full.token_ids
    jsonschema.validate(json.loads(tok.decode(full.token_ids[:k]) + rest.text), SCHEMA)
    with pytest.raises(InvalidRequest):  # a prefix the guide never allows
        engine.add(EngineRequest("bad", prompt, params, resume_token_ids=tok.encode("nope")))


@pytest.mark.parametrize(
    "guide",
    [
        Guide(json='{"$ref": "#/nope"}'),
        Guide(json='{"type": "frob"}'),
        Guide(json="{not json"),
        Guide(regex="(ab"),
        Guide(grammar="root ::= undefined_rule"),
        Guide(choice=()),
        Guide(regex="a", choice=("a",)),
    ],
    ids=["ref", "type", "notjson", "regex", "grammar", "nochoice", "two"],
)
async def test_bad_guides_are_invalid_requests(engine: HFEngineBase, guide: Guide) -> None:
    prompt = engine.tokenizer.encode(PROMPTS[0])
    await engine.ready_for(sampled(0, guide))  # never raises: add does
    with pytest.raises(InvalidRequest) as err:
        engine.add(EngineRequest("bad", prompt, sampled(0, guide)))
    assert err.value.param == "response_format"
    # the engine goes on
    r = await run_one(engine, prompt, greedy(4), "after")
    assert len(r.token_ids) == 4


async def test_a_guide_compiles_off_the_loop_and_add_finds_it_done(engine: HFEngineBase) -> None:
    """`ready_for` compiles in a thread while the loop runs on; `add` then waits for nothing.
    A compilation that outlives the deadline fails the attempt (retried), never as the
    client's error, and `add` does not wait the deadline out a second time."""
    tok = engine.tokenizer
    compiler = engine._guide_compiler()
    compile_now = compiler._compile_now
    release = threading.Event()

    def slow(guide: Guide, kind: str) -> object:
        release.wait(0.5 if guide.regex == "[0-9]{4}" else 10)
        return compile_now(guide, kind)

    compiler._compile_now = slow  # type: ignore[method-assign,assignment]
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    ticker = asyncio.create_task(tick())
    try:
        params = sampled(3, Guide(regex="[0-9]{4}"), max_tokens=8)
        await engine.ready_for(params)
        assert ticks >= 10  # the loop went on while it compiled
        began = time.monotonic()
        engine.add(EngineRequest("g", tok.encode(PROMPTS[3]), params))
        assert time.monotonic() - began < 0.2
        assert re.fullmatch(r"[0-9]{4}", (await collect(engine, 1))["g"].text)

        compiler.timeout = 0.3
        stuck = sampled(3, Guide(regex="[a-z]{4}"), max_tokens=8)
        await engine.ready_for(stuck)  # waits the deadline out, off the loop; never raises
        began = time.monotonic()
        with pytest.raises(EngineError, match="did not compile within") as err:
            engine.add(EngineRequest("s", tok.encode(PROMPTS[3]), stuck))
        assert not isinstance(err.value, InvalidRequest)
        assert time.monotonic() - began < 0.2
        release.set()
        await engine.ready_for(stuck)  # the retry: compiled by then
        engine.add(EngineRequest("s", tok.encode(PROMPTS[3]), stuck))
        assert re.fullmatch(r"[a-z]{4}", (await collect(engine, 1))["s"].text)
    finally:
        release.set()
        ticker.cancel()


async def test_constrained_row_leaves_its_batch_unchanged(engine: HFEngineBase) -> None:
    tok = engine.tokenizer
    alone = {}
    for i, p in enumerate(PROMPTS):
        alone[i] = (await run_one(engine, tok.encode(p), greedy(20), f"a{i}")).token_ids
    guide = Guide(json=json.dumps(SCHEMA))
    engine.add(EngineRequest("c", tok.encode(PROMPTS[0]), sampled(1, guide)))
    engine.add(
        EngineRequest("pen", tok.encode(PROMPTS[1]), greedy(20, frequency_penalty=2, logprobs=3))
    )
    for i, p in enumerate(PROMPTS):
        engine.add(EngineRequest(f"b{i}", tok.encode(p), greedy(20)))
    res = await collect(engine, len(PROMPTS) + 2)
    for i in range(len(PROMPTS)):
        assert res[f"b{i}"].token_ids == alone[i]
    jsonschema.validate(json.loads(res["c"].text), SCHEMA)
    assert not math.isnan(sum(lp.logprob for o in res["pen"].outputs for lp in o.logprobs or []))


async def test_plain_requests_cost_no_feature_work(tiny_model_path: Path) -> None:
    """Without a row that uses a feature the CPU engine allocates and fills no buffers; after
    one, its rows are reset and later plain steps skip them again."""
    eng = HFEngine(str(tiny_model_path), max_seqs=8, max_tokens=4096, threads=1)
    await eng.start()
    try:
        prompt = eng.tokenizer.encode(PROMPTS[0])
        plain = (await run_one(eng, prompt, greedy(8), "p")).token_ids
        processor = eng._processor
        assert processor is not None and processor._adjust is None
        await run_one(eng, prompt, greedy(8, presence_penalty=1.0), "f")
        assert processor._adjust is not None
        assert (await run_one(eng, prompt, greedy(8), "p2")).token_ids == plain
        assert not processor._adjust.dirty and not processor._adjusting
    finally:
        await eng.stop()
