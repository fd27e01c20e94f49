"""SimEngine's decoding fields: each reshapes its one fixed distribution as it would a real
model's, logprobs are that distribution's own, guides write text in shape, resume is exact."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import jsonschema
import pytest

from tests.engines.clock import VirtualClock
from tests.engines.outputs import Result, collect
from tokenyard.engines import EngineRequest
from tokenyard.engines.sim import _ALPHABET, SimEngine, SimTokenizer, guided_text
from tokenyard.errors import InvalidRequest
from tokenyard.limits import refusal
from tokenyard.messages import Feature, FinishReason, Guide, SamplingParams

PROMPT = "tell me something"


def params(max_tokens: int = 30, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


@pytest.fixture
async def engine() -> AsyncIterator[SimEngine]:
    eng = SimEngine(sleep=VirtualClock().sleep, logprobs=True)
    await eng.start()
    yield eng
    await eng.stop()


async def run(
    engine: SimEngine, seq_id: str, p: SamplingParams, resume: Sequence[int] = ()
) -> Result:
    prompt = engine.tokenizer.encode(PROMPT)
    engine.add(EngineRequest(seq_id, prompt, p, resume_token_ids=resume))
    return (await collect(engine, 1))[seq_id]


def tok(ch: str) -> int:
    return ord(ch) + SimTokenizer.OFFSET


async def test_it_declares_what_it_implements(engine: SimEngine) -> None:
    assert engine.limits().features == frozenset(Feature)
    assert engine.limits().engine == "sim"
    assert refusal(3, params(logprobs=20), engine.limits()) is None
    # logprobs of its made-up distribution only where asked for: by default refused by name
    plain = SimEngine().limits()
    assert plain.features == frozenset(Feature) - {Feature.LOGPROBS, Feature.PROMPT_LOGPROBS}
    refused = refusal(3, params(logprobs=1), plain)
    assert refused is not None and refused.param == "logprobs"
    refused = refusal(3, params(prompt_logprobs=1), plain)
    assert refused is not None and refused.param == "prompt_logprobs"
    assert refusal(3, params(logit_bias=((5, 1.0),), guide=Guide(choice=("a",))), plain) is None


async def test_stop_token_ids_end_it_kept_in_ids_not_text(engine: SimEngine) -> None:
    plain = await run(engine, "plain", params())
    stop = plain.token_ids[5]
    first = plain.token_ids.index(stop)
    for ignore_eos in (False, True):  # as vLLM: stop_token_ids hold under ignore_eos
        p = params(stop_token_ids=(stop,), ignore_eos=ignore_eos)
        r = await run(engine, f"stop{ignore_eos}", p)
        assert r.token_ids == plain.token_ids[: first + 1]
        assert r.text == engine.tokenizer.decode(plain.token_ids[:first])
        assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP


async def test_min_tokens_hold_off_eos_and_stop_ids() -> None:
    engine = SimEngine(sleep=VirtualClock().sleep, eos_rate=1.0)  # EOS is every draw
    await engine.start()
    try:
        r = await run(engine, "eos", params())
        assert r.token_ids == [SimTokenizer.EOS]
        r = await run(engine, "min", params(min_tokens=5))
        assert len(r.token_ids) == 6 and r.token_ids[-1] == SimTokenizer.EOS
        assert SimTokenizer.EOS not in r.token_ids[:5]
        assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    finally:
        await engine.stop()
    engine = SimEngine(sleep=VirtualClock().sleep)
    await engine.start()
    try:
        forced = {"logit_bias": ((tok("z"), 100.0),), "stop_token_ids": (tok("z"),)}
        r = await run(engine, "stopz", params(**forced))
        assert r.token_ids == [tok("z")]
        r = await run(engine, "minz", params(min_tokens=4, **forced))
        assert len(r.token_ids) == 5 and r.token_ids[-1] == tok("z")
        assert tok("z") not in r.token_ids[:4]
    finally:
        await engine.stop()


async def test_logit_bias_forces_and_bans(engine: SimEngine) -> None:
    r = await run(engine, "force", params(10, logit_bias=((tok("Q"), 100.0),)))
    assert r.text == "Q" * 10  # "Q" is not even in its alphabet: the floor lifts
    banned = tuple((tok(chr(c)), -100.0) for c in set(_ALPHABET) if chr(c) != "e")
    r = await run(engine, "ban", params(10, logit_bias=banned))
    assert r.text == "e" * 10


async def test_penalties_spread_what_it_draws(engine: SimEngine) -> None:
    plain = await run(engine, "plain", params(200))
    most = Counter(plain.token_ids).most_common(1)[0][1]
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        r = await run(engine, name, params(200, **{name: 2.0}))
        assert r.token_ids != plain.token_ids
        assert Counter(r.token_ids).most_common(1)[0][1] < most, name


async def test_logprobs_are_its_distributions(engine: SimEngine) -> None:
    r = await run(engine, "lp", params(40, logprobs=3))
    lps = [lp for out in r.outputs for lp in out.logprobs or ()]
    assert [lp.token_id for lp in lps] == r.token_ids
    counts = Counter(_ALPHABET)
    space = tok(" ")
    for lp in lps:
        byte = lp.token_id - SimTokenizer.OFFSET
        assert lp.logprob == pytest.approx(math.log(counts[byte] / len(_ALPHABET)))
        # space is the likeliest (5 of 33), then the singles by id
        assert [t for t, _ in lp.top] == [space, tok(","), tok(".")]
        assert lp.top[0][1] == pytest.approx(math.log(5 / len(_ALPHABET)))
    none = await run(engine, "nolp", params(40))
    assert none.token_ids == r.token_ids  # asking for logprobs changes nothing drawn
    assert all(out.logprobs is None for out in none.outputs)
    r = await run(engine, "lp0", params(5, logprobs=0))
    assert all(lp.top == () for out in r.outputs for lp in out.logprobs or ())


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "tier": {"enum": ["gold", "silver"]},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 2},
        "ok": {"type": "boolean"},
        "note": {"type": ["string", "null"], "maxLength": 2},
    },
    "required": ["name", "age", "tier", "tags", "ok", "note"],
    "$defs": {"tag": {"type": "number", "exclusiveMinimum": 0.5}},
}


async def test_guides_write_in_shape(engine: SimEngine) -> None:
    r = await run(engine, "json", params(200, guide=Guide(json=json.dumps(SCHEMA))))
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    jsonschema.validate(json.loads(r.text), SCHEMA)
    r = await run(engine, "obj", params(guide=Guide(json_object=True)))
    assert json.loads(r.text) == {}
    choices = ("alpha", "beta", "gamma")
    seen = set()
    for i in range(6):
        prompt = engine.tokenizer.encode(f"pick {i}")
        engine.add(EngineRequest(f"c{i}", prompt, params(guide=Guide(choice=choices))))
        r = (await collect(engine, 1))[f"c{i}"]
        assert r.text in choices
        seen.add(r.text)
    assert len(seen) > 1  # the pick depends on the prompt
    r = await run(engine, "cut", params(3, guide=Guide(choice=choices)))
    assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
    assert any(c.startswith(r.text) for c in choices)


async def test_guides_it_cannot_follow_are_refused(engine: SimEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    for guide in (
        Guide(regex="[a-z]+"),
        Guide(grammar='root ::= "x"'),
        Guide(json=json.dumps({"type": "string", "pattern": "^a+$"})),
    ):
        with pytest.raises(InvalidRequest) as info:
            engine.add(EngineRequest("no", prompt, params(guide=guide)))
        assert info.value.param == "response_format"
    assert guided_text(Guide(json='{"type": "integer", "maximum": -3}'), 0) == "-3"


@pytest.mark.parametrize(
    "p",
    [
        params(40, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.5),
        params(40, logit_bias=((tok("e"), 2.0),), min_tokens=10, logprobs=2),
        params(40, guide=Guide(json=json.dumps(SCHEMA))),
        SamplingParams(max_tokens=40, temperature=0.8, seed=3, presence_penalty=1.0),
    ],
    ids=["penalties", "bias", "json", "seeded"],
)
async def test_resume_is_exact(engine: SimEngine, p: SamplingParams) -> None:
    whole = await run(engine, "whole", p)
    for k in (1, 9, len(whole.token_ids) - 1):
        r = await run(engine, f"r{k}", p, whole.token_ids[:k])
        assert whole.token_ids[:k] + r.token_ids == whole.token_ids
        assert whole.text.endswith(r.text)
        if p.logprobs is not None:
            lps = [lp for out in whole.outputs for lp in out.logprobs or ()]
            assert [lp for out in r.outputs for lp in out.logprobs or ()] == lps[k:]
