"""The remote engine's decoding fields against a scripted upstream: what goes up (the request
body, as vLLM's completions API takes it), how logprobs come back, and how a sequence whose
decoding depends on its own output resumes (asked again from its prompt, checked)."""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest

pytest.importorskip("transformers")

from tests.engines.outputs import Result, collect
from tests.engines.upstream import ScriptedUpstream
from tokenyard.engines import EngineRequest, make_engine
from tokenyard.engines.remote import RemoteEngine
from tokenyard.messages import Feature, FinishReason, Guide, SamplingParams, TokenLogprob

PROMPT = [5, 17, 42, 99]


def model(context: list[int]) -> int:
    """The scripted upstream's greedy "model": the next token from the last two (so prompt +
    resumed tokens continue exactly as the unbroken run did); with its alternatives, all
    tokens of the tiny tokenizer whose texts are theirs alone (its bytes past ASCII are not)."""
    return 30 + (context[-1] * 7 + context[-2] * 3) % 40


def alternatives(token: int) -> list[tuple[int, float]]:
    """Its most likely tokens at a position, most likely first: the chosen one ranks second."""
    return [(token + 1, -0.1), (token, -0.25), *((token + 2 + i, -1.0 - i) for i in range(20))]


class Model:
    """Answers a completions body as `model` would, logprobs rendered as vLLM renders them
    (`token_id:N` when asked, else the token's text); `skew`: requests after the first start
    with a different token (an upstream that does not repeat itself)."""

    def __init__(self, engine: RemoteEngine, *, ids_as_text: bool = False, skew: bool = False):
        self.engine, self.ids_as_text, self.skew = engine, ids_as_text, skew
        self.calls = 0

    def name(self, token: int, body: dict[str, Any]) -> str:
        if body.get("return_tokens_as_token_ids") and not self.ids_as_text:
            return f"token_id:{token}"
        return self.engine.tokenizer.decode([token])

    def __call__(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.calls += 1
        context = list(body["prompt"])
        n = body["max_tokens"]
        for i in range(n):
            token = model(context) + (1 if self.skew and self.calls > 1 and i == 0 else 0)
            context.append(token)
            choice: dict[str, Any] = {
                "index": 0,
                "text": "x",
                "token_ids": [token],
                "finish_reason": "length" if i == n - 1 else None,
            }
            if (k := body.get("logprobs")) is not None:
                top = alternatives(token)[:k]
                shown = dict(top) | {token: -0.25}  # the chosen one always, as vLLM
                choice["logprobs"] = {
                    "tokens": [self.name(token, body)],
                    "token_logprobs": [-0.25],
                    "top_logprobs": [{self.name(t, body): lp for t, lp in shown.items()}],
                    "text_offset": [0],
                }
            yield choice


@pytest.fixture
async def engine() -> AsyncIterator[RemoteEngine]:
    # the url is set per test, once its upstream listens
    eng = make_engine("remote", model="tiny", url="http://127.0.0.1:1", backoff_s=0.01)
    assert isinstance(eng, RemoteEngine)
    yield eng
    await eng.stop()


async def serve(engine: RemoteEngine, upstream: ScriptedUpstream) -> None:
    engine.url = await upstream.start()
    await engine.start()


async def run(
    engine: RemoteEngine, seq_id: str, params: SamplingParams, resume: list[int] | None = None
) -> Result:
    engine.add(EngineRequest(seq_id, PROMPT, params, resume_token_ids=resume or ()))
    return (await collect(engine, 1, 30))[seq_id]


def greedy(max_tokens: int = 8, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def unbroken(n: int) -> list[int]:
    context = list(PROMPT)
    for _ in range(n):
        context.append(model(context))
    return context[len(PROMPT) :]


async def test_every_field_goes_up_as_vllm_takes_it(engine: RemoteEngine) -> None:
    # all but the prompt's logprobs: vLLM gives none to a stream
    assert engine.limits().features == frozenset(Feature) - {Feature.PROMPT_LOGPROBS}
    upstream = ScriptedUpstream(Model(engine))
    await serve(engine, upstream)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = greedy(
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.2,
        logit_bias=((7, -100.0), (300, 2.5)),
        min_tokens=3,
        stop_token_ids=(2, 9),
        logprobs=4,
        guide=Guide(json=json.dumps(schema)),
    )
    r = await run(engine, "all", params)
    assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
    (body,) = upstream.bodies
    assert body["prompt"] == PROMPT and body["max_tokens"] == 8
    fields = {k: body[k] for k in body if k not in ("prompt", "max_tokens", "model")}
    assert fields == {
        "temperature": 0.0,
        "top_p": 1.0,
        "stream": True,
        "return_token_ids": True,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": -100.0, "300": 2.5},
        "min_tokens": 3,
        "stop_token_ids": [2, 9],
        "logprobs": 4,
        "return_tokens_as_token_ids": True,
        "structured_outputs": {"json": schema},
    }
    for guide, sent in [
        (Guide(json_object=True), {"json_object": True}),
        (Guide(regex="[a-z]+"), {"regex": "[a-z]+"}),
        (Guide(choice=("a", "b")), {"choice": ["a", "b"]}),
        (Guide(grammar='root ::= "x"'), {"grammar": 'root ::= "x"'}),
    ]:
        await run(engine, f"g{len(upstream.bodies)}", greedy(2, guide=guide))
        assert upstream.bodies[-1]["structured_outputs"] == sent
    # vLLM's extra fields go up too; the text switches stay here, where the text is made
    extra = greedy(
        2,
        min_p=0.2,
        allowed_token_ids=(5, 9, 300),
        bad_words=("no", "never"),
        cache_salt="salt",
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    await run(engine, "extra", extra)
    sent = {k: upstream.bodies[-1].get(k) for k in ("min_p", "allowed_token_ids", "bad_words")}
    assert sent == {"min_p": 0.2, "allowed_token_ids": [5, 9, 300], "bad_words": ["no", "never"]}
    assert upstream.bodies[-1]["cache_salt"] == "salt"
    assert "skip_special_tokens" not in upstream.bodies[-1]
    assert "include_stop_str_in_output" not in upstream.bodies[-1]
    # a plain request carries none of them
    await run(engine, "plain", greedy(2))
    assert set(upstream.bodies[-1]) == {
        "model", "prompt", "max_tokens", "temperature", "top_p", "stream", "return_token_ids",
    }  # fmt: skip
    await upstream.close()


@pytest.mark.parametrize("ids_as_text", [False, True], ids=["token_ids", "token_texts"])
async def test_logprobs_come_back_by_position(engine: RemoteEngine, ids_as_text: bool) -> None:
    upstream = ScriptedUpstream(Model(engine, ids_as_text=ids_as_text))
    await serve(engine, upstream)
    for k in (0, 1, 5):
        r = await run(engine, f"lp{k}", greedy(6, logprobs=k))
        assert r.token_ids == unbroken(6)
        got = [lp for out in r.outputs for lp in out.logprobs or ()]
        # the chosen token ranks second: in the top k from k = 2, its own logprob always
        assert got == [TokenLogprob(t, -0.25, tuple(alternatives(t)[:k])) for t in r.token_ids]
    r = await run(engine, "none", greedy(6))
    assert all(out.logprobs is None for out in r.outputs)
    await upstream.close()


@pytest.mark.parametrize("one_write", [False, True], ids=["write_each", "one_write"])
async def test_events_read_together_come_out_as_events_read_one_by_one(
    engine: RemoteEngine, one_write: bool
) -> None:
    """An upstream's events that arrive in one read are fed to the decoder together: the same
    tokens, text and logprobs, and a stop string inside them ends the text where it starts."""
    upstream = ScriptedUpstream(Model(engine), one_write=one_write)
    await serve(engine, upstream)
    whole = unbroken(8)
    r = await run(engine, "lp", greedy(8, logprobs=2))
    assert r.token_ids == whole
    assert r.text == engine.tokenizer.decode(whole)
    got = [lp for out in r.outputs for lp in out.logprobs or ()]
    assert got == [TokenLogprob(t, -0.25, tuple(alternatives(t)[:2])) for t in whole]
    assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
    if one_write:  # one read's events came out together
        assert len([out for out in r.outputs if out.token_ids]) < len(whole)
    # a stop string: the text of the fifth and sixth tokens, wherever it first shows
    text = engine.tokenizer.decode(whole)
    stop = text[len(engine.tokenizer.decode(whole[:4])) : len(engine.tokenizer.decode(whole[:6]))]
    assert stop.strip()
    r = await run(engine, "stop", greedy(8, stop=[stop]))
    assert r.text == text[: text.index(stop)]
    assert r.finish is not None and r.finish.finish_reason is FinishReason.STOP
    await upstream.close()


async def test_token_texts_are_looked_up_in_a_table_built_off_the_loop(
    engine: RemoteEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first upstream that names tokens by text has the vocabulary's texts tabled, one
    decode per token, in a thread: the loop (every other stream) does not wait for it."""
    loop_thread = threading.get_ident()
    on_loop = 0
    decode = engine.tokenizer.decode

    def counting(ids: Sequence[int]) -> str:
        nonlocal on_loop
        on_loop += threading.get_ident() == loop_thread
        return decode(ids)

    monkeypatch.setattr(engine.tokenizer, "decode", counting)
    upstream = ScriptedUpstream(Model(engine, ids_as_text=True))
    await serve(engine, upstream)
    r = await run(engine, "lp", greedy(6, logprobs=5))
    got = [lp for out in r.outputs for lp in out.logprobs or ()]
    assert got == [TokenLogprob(t, -0.25, tuple(alternatives(t)[:5])) for t in r.token_ids]
    assert engine._token_strings is not None
    assert on_loop < 100 < engine.tokenizer.vocab_size  # the stream's own tokens, not the table
    await upstream.close()


async def test_a_plain_resume_continues_the_prompt_with_min_tokens_counted(
    engine: RemoteEngine,
) -> None:
    upstream = ScriptedUpstream(Model(engine))
    await serve(engine, upstream)
    whole = unbroken(10)
    r = await run(engine, "resumed", greedy(10, min_tokens=5, logprobs=1), whole[:3])
    assert whole[:3] + r.token_ids == whole
    (body,) = upstream.bodies
    assert body["prompt"] == PROMPT + whole[:3]
    assert body["max_tokens"] == 7 and body["min_tokens"] == 2
    assert [lp.token_id for out in r.outputs for lp in out.logprobs or ()] == whole[3:]
    await upstream.close()


GUIDED = [
    greedy(10, guide=Guide(choice=("x", "y")), logprobs=2),
    greedy(10, presence_penalty=1.0),
    SamplingParams(max_tokens=10, temperature=0.7, seed=4, frequency_penalty=0.5),
]


@pytest.mark.parametrize("params", GUIDED, ids=["guide", "presence", "seeded-frequency"])
async def test_a_resume_that_depends_on_its_output_asks_again_and_skips_what_was_sent(
    engine: RemoteEngine, params: SamplingParams
) -> None:
    upstream = ScriptedUpstream(Model(engine))
    await serve(engine, upstream)
    whole = unbroken(10)
    r = await run(engine, "resumed", params, whole[:4])
    assert whole[:4] + r.token_ids == whole
    assert r.finish is not None and r.finish.finish_reason is FinishReason.LENGTH
    assert r.finish.completion_tokens == 10
    (body,) = upstream.bodies
    assert body["prompt"] == PROMPT and body["max_tokens"] == 10  # from the start
    if params.logprobs is not None:
        assert [lp.token_id for out in r.outputs for lp in out.logprobs or ()] == whole[4:]
    await upstream.close()


async def test_a_dropped_guided_stream_is_retried_from_the_prompt(engine: RemoteEngine) -> None:
    upstream = ScriptedUpstream(Model(engine), cut_after=3)
    await serve(engine, upstream)
    r = await run(engine, "cut", greedy(10, guide=Guide(regex="[0-9]+")))
    assert r.token_ids == unbroken(10)
    assert [b["prompt"] for b in upstream.bodies] == [PROMPT, PROMPT]
    await upstream.close()


async def test_an_upstream_that_does_not_repeat_itself_fails_the_resume(
    engine: RemoteEngine,
) -> None:
    upstream = ScriptedUpstream(Model(engine, skew=True))
    await serve(engine, upstream)
    await run(engine, "first", greedy(2))  # the upstream's first answer is as `model`
    r = await run(engine, "resumed", greedy(10, guide=Guide(choice=("x",))), unbroken(4))
    assert r.token_ids == []
    assert r.finish is not None and r.finish.finish_reason is FinishReason.ERROR
    assert r.finish.error is not None and "cannot resume" in r.finish.error
    await upstream.close()
