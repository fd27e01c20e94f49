"""vLLM's extra sampling and text fields in the engines: min_p, allowed_token_ids and bad_words
on both transformers engines (real forward passes of the tiny model, checked against the
logits of a plain forward pass), the detokenization switches in the shared decoder, and the
salt of the hf engine's and the sim's prefix caches."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tests.engines.outputs import Result, collect
from tokenyard.engines import EngineRequest
from tokenyard.engines.badwords import bad_words_token_ids, banned_tokens
from tokenyard.engines.detok import SequenceDecoder
from tokenyard.engines.hf import HFEngine, HFEngineBase, HFSeq
from tokenyard.engines.hf_static import HFStaticEngine
from tokenyard.engines.hf_tokenizer import HFTokenizer
from tokenyard.engines.sampling import apply_min_p
from tokenyard.engines.sim import PrefixCache, SimEngine, SimTokenizer
from tokenyard.errors import InvalidRequest
from tokenyard.messages import Feature, FinishReason, SamplingParams

PROMPT = "Once upon a time there was"


@pytest.fixture(params=["hf", "hf-static"])
async def engine(
    tiny_model_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[HFEngineBase]:
    eng: HFEngineBase
    if request.param == "hf":
        eng = HFEngine(str(tiny_model_path), max_seqs=16, max_tokens=16384, threads=1)
    else:
        eng = HFStaticEngine(
            str(tiny_model_path), batch_size=8, batch_timeout_ms=5, max_seqs=16, threads=1
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


async def run(engine: HFEngineBase, params: SamplingParams, sid: str) -> Result:
    engine.add(EngineRequest(sid, engine.tokenizer.encode(PROMPT), params))
    return (await collect(engine, 1))[sid]


async def test_min_p_keeps_only_tokens_near_the_most_likely(engine: HFEngineBase) -> None:
    """Sampled hot (temperature 2), every token is at least min_p times as likely as the
    best one under the temperature-scaled distribution; without min_p the same seed picks a
    token that is not."""
    prompt = engine.tokenizer.encode(PROMPT)
    hot = {"max_tokens": 24, "temperature": 2.0, "seed": 11, "ignore_eos": True}
    plain = await run(engine, SamplingParams(**hot), "plain")  # type: ignore[arg-type]
    kept = await run(engine, SamplingParams(**hot, min_p=0.5), "min_p")  # type: ignore[arg-type]

    def ratios(out: list[int]) -> list[float]:
        probs = (forward_logits(engine, prompt, out) / 2.0).softmax(-1)
        return [float(probs[i, t] / probs[i].max()) for i, t in enumerate(out)]

    assert min(ratios(kept.token_ids)) >= 0.5 - 1e-4
    assert min(ratios(plain.token_ids)) < 0.5, "min_p would change nothing here"


def test_min_p_on_rows() -> None:
    scores = torch.tensor([[0.0, -0.5, -3.0], [0.0, -0.5, -3.0]])
    out = apply_min_p(scores, torch.tensor([0.5, 0.0]))
    # row 0: e^-0.5 ~ 0.61 of the best stays, e^-3 goes; row 1: min_p 0 leaves it as it is
    assert out[0].tolist() == [0.0, -0.5, float("-inf")]
    assert torch.equal(out[1], scores[1])


async def test_allowed_token_ids_restrict_every_greedy_token(engine: HFEngineBase) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    plain = await run(engine, SamplingParams(max_tokens=12, temperature=0.0), "plain")
    # the plain run's tokens minus its first: the first choice must fall elsewhere
    allowed = tuple(sorted({*plain.token_ids[1:], 100, 200, 300} - {plain.token_ids[0]}))
    params = SamplingParams(max_tokens=12, temperature=0.0, allowed_token_ids=allowed)
    res = await run(engine, params, "allowed")
    assert res.token_ids and set(res.token_ids) <= set(allowed)
    logits = forward_logits(engine, prompt, res.token_ids)
    index = torch.tensor(allowed)
    for i, tok in enumerate(res.token_ids):
        assert allowed[int(logits[i, index].argmax())] == tok, f"token {i}"


async def test_bad_words_never_appear_in_the_output(engine: HFEngineBase) -> None:
    """Words of the greedy run's own text, banned: their token sequences are never generated,
    and each token is the argmax once what the words ban at that point is masked."""
    tok = engine.tokenizer
    prompt = tok.encode(PROMPT)
    plain = await run(engine, SamplingParams(max_tokens=16, temperature=0.0), "plain")
    words = banning_words(plain.token_ids, tok)
    assert words, plain.text
    params = SamplingParams(max_tokens=16, temperature=0.0, bad_words=tuple(words))
    res = await run(engine, params, "bad")
    sequences = bad_words_token_ids(words, lambda t: tok.encode(t, add_special_tokens=False))
    out = res.token_ids
    assert out != plain.token_ids
    assert not any(occurs(ids, out) for ids in sequences)
    logits = forward_logits(engine, prompt, out)
    for i, t in enumerate(out):
        row = logits[i].clone()
        row[sorted(banned_tokens(sequences, out[:i]))] = float("-inf")
        assert int(row.argmax()) == t, f"token {i}"


def occurs(ids: tuple[int, ...], out: list[int]) -> bool:
    return any(tuple(out[i : i + len(ids)]) == ids for i in range(len(out) - len(ids) + 1))


def banning_words(out: list[int], tok: HFTokenizer) -> list[str]:
    """Words (plain letters) of a run's tokens whose token sequences, as vLLM makes them of
    bad words, occur in it: banned, the run must change (vLLM tokenizes a word bare, and
    with a space only where that gives as many tokens, so not every word of a text would)."""
    found = []
    for t in out:
        word = tok.decode([t]).strip()
        ids = bad_words_token_ids([word], lambda w: tok.encode(w, add_special_tokens=False))
        if word.isascii() and word.isalpha() and any(occurs(x, out) for x in ids):
            found.append(word)
    return found[:2]


def test_bad_words_as_vllm_tokenizes_and_matches_them() -> None:
    tok = SimTokenizer()  # bytes: a space is a token of its own
    assert bad_words_token_ids(["ab", " c"], tok.encode) == [
        tuple(tok.encode("ab")),
        tuple(tok.encode("c")),
    ]
    ab = tuple(tok.encode("ab"))
    assert banned_tokens([ab], []) == set()  # the output does not end with "a"
    assert banned_tokens([ab], tok.encode("xa")) == {ab[1]}
    assert banned_tokens([ab[:1]], []) == {ab[0]}  # one token: always


async def test_a_bad_word_beyond_the_vocabulary_is_the_requests_fault(
    tiny_model_path: Path,
) -> None:
    eng = HFEngine(str(tiny_model_path), max_seqs=4, max_tokens=4096, threads=1)
    tok = eng.tokenizer
    eng.logits_vocab = min(tok.encode("zebra", add_special_tokens=False))  # pretend a smaller one
    with pytest.raises(InvalidRequest) as refused:
        eng.add(EngineRequest("s", tok.encode(PROMPT), SamplingParams(bad_words=("zebra",))))
    assert refused.value.param == "bad_words"


async def test_special_tokens_shown_when_not_skipped(engine: HFEngineBase) -> None:
    """A special token forced by logit_bias: its text is in the output only with
    skip_special_tokens false; the ending EOS's only with include_stop_str_in_output too."""
    tok = engine.tokenizer
    user = tok.hf.convert_tokens_to_ids("<|user|>")
    eos = min(tok.eos_token_ids)
    forced = {"max_tokens": 3, "temperature": 0.0, "logit_bias": ((user, 100.0),)}
    skipped = await run(engine, SamplingParams(**forced, ignore_eos=True), "skip")  # type: ignore[arg-type]
    shown = await run(
        engine,
        SamplingParams(**forced, ignore_eos=True, skip_special_tokens=False),  # type: ignore[arg-type]
        "show",
    )
    assert skipped.token_ids == shown.token_ids == [user] * 3
    assert skipped.text == "" and shown.text == "<|user|>" * 3
    ending = {"max_tokens": 5, "temperature": 0.0, "logit_bias": ((eos, 100.0),)}
    plain = await run(engine, SamplingParams(**ending, skip_special_tokens=False), "eos")  # type: ignore[arg-type]
    kept = await run(
        engine,
        SamplingParams(**ending, skip_special_tokens=False, include_stop_str_in_output=True),  # type: ignore[arg-type]
        "eos-kept",
    )
    assert plain.token_ids == kept.token_ids == [eos]
    assert plain.finish is not None and kept.finish is not None
    assert plain.finish.finish_reason == kept.finish.finish_reason == FinishReason.STOP
    assert plain.text == "" and kept.text == "<|eos|>"


def test_the_decoder_keeps_a_stop_string_when_asked() -> None:
    tok = SimTokenizer()
    ids = tok.encode("hello world, again")
    for include, text in ((False, "hello "), (True, "hello world")):
        params = SamplingParams(max_tokens=32, stop=("world",), include_stop_str_in_output=include)
        dec = SequenceDecoder(tok.decode, params, prompt_ids=tok.encode("> "))
        out = "".join(dec.feed([t]).text for t in ids if dec.finish_reason is None)
        assert (out, dec.finish_reason) == (text, FinishReason.STOP)


def test_the_decoder_shows_special_tokens_and_a_stop_id_when_asked() -> None:
    tok = SimTokenizer()
    ids = [*tok.encode("ab"), tok.BOS, *tok.encode("c"), tok.EOS]
    for params, text in (
        (SamplingParams(max_tokens=9), "abc"),
        (SamplingParams(max_tokens=9, skip_special_tokens=False), "ab<s>c"),
        (
            SamplingParams(
                max_tokens=9, skip_special_tokens=False, include_stop_str_in_output=True
            ),
            "ab<s>c</s>",
        ),
    ):
        dec = SequenceDecoder(tok.decode, params, prompt_ids=[], eos_token_ids=(tok.EOS,))
        assert dec.feed(ids).text == text
        assert dec.finish_reason == FinishReason.STOP


def _spaced_tokenizer() -> HFTokenizer:
    """A WordPiece tokenizer: its decoder joins tokens with spaces, special ones too."""
    vocab = {"[UNK]": 0, "<a>": 1, "<b>": 2, "hi": 3, "there": 4}
    raw = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    hf.add_special_tokens({"additional_special_tokens": ["<a>", "<b>"]})
    return HFTokenizer(hf, max_model_len=64)


def test_no_spaces_between_special_tokens_when_asked() -> None:
    tok = _spaced_tokenizer()
    ids = [3, 1, 2, 1, 4]  # hi <a> <b> <a> there
    assert tok.decode(ids) == "hi there"
    spaced = tok.decode(ids, skip_special_tokens=False)
    assert spaced == "hi <a> <b> <a> there"
    # vLLM's rule: a special token right after another is its bare text
    bare = tok.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert bare == "hi <a><b><a> there"


def test_the_hf_engine_keeps_salted_sequences_out_of_block_sharing(tiny_model_path: Path) -> None:
    eng = HFEngine(str(tiny_model_path), max_seqs=4, max_tokens=4096, threads=1)
    calls: list[tuple[str, str]] = []
    cache = SimpleNamespace(
        search_prefix_match=lambda rid, ids: calls.append(("search", rid)) or 32,
        mark_complete_blocks=lambda state, blocks: calls.append(("mark", state.request_id)),
    )
    eng._isolate_salted(cache)

    for rid, salt in (("plain#0", None), ("salted#1", "s3cret")):
        s = HFSeq.__new__(HFSeq)
        s.params = SamplingParams(cache_salt=salt)
        eng._by_internal[rid] = s
    assert cache.search_prefix_match("plain#0", [1, 2]) == 32
    assert cache.search_prefix_match("salted#1", [1, 2]) == 0
    cache.mark_complete_blocks(SimpleNamespace(request_id="plain#0"), {"full": 1})
    cache.mark_complete_blocks(SimpleNamespace(request_id="salted#1"), {"full": 1})
    assert calls == [("search", "plain#0"), ("mark", "plain#0")]


async def test_a_salted_sequence_generates_what_an_unsalted_one_does(engine: HFEngineBase) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    plain = await run(engine, params, "plain")
    salted = await run(engine, SamplingParams(max_tokens=8, temperature=0.0, cache_salt="x"), "s")
    assert salted.token_ids == plain.token_ids


def test_the_sims_prefix_cache_hits_only_its_own_salt() -> None:
    cache = PrefixCache(capacity_tokens=1024)
    ids = list(range(64))
    assert cache.lookup_and_insert(ids) == 0
    assert cache.lookup_and_insert(ids) == 64
    assert cache.lookup_and_insert(ids, "a") == 0
    assert cache.lookup_and_insert(ids, "a") == 64
    assert cache.lookup_and_insert(ids, "b") == 0


async def test_the_sim_honours_the_masks() -> None:
    eng = SimEngine(decode_base=0.0, decode_per_seq=0.0, prefill_base=0.0, prefill_per_token=0.0)
    await eng.start()
    try:
        tok = eng.tokenizer
        prompt = tok.encode("hello")
        allowed = tuple(sorted(tok.encode("xyz")))
        eng.add(
            EngineRequest("a", prompt, SamplingParams(max_tokens=20, allowed_token_ids=allowed))
        )
        eng.add(EngineRequest("b", prompt, SamplingParams(max_tokens=40, bad_words=("e", "t"))))
        eng.add(EngineRequest("c", prompt, SamplingParams(max_tokens=40)))
        out = await collect(eng, 3)
        assert set(out["a"].text) <= set("xyz") and len(out["a"].text) == 20
        assert not {"e", "t"} & set(out["b"].text)
        assert {"e", "t"} & set(out["c"].text), "the plain run has neither: nothing was tested"
    finally:
        await eng.stop()


async def test_prompt_logprobs_match_a_forward_pass(engine: HFEngineBase) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3)
    res = await run(engine, params, "prompt-lp")
    given = [o.prompt_logprobs for o in res.outputs if o.prompt_logprobs is not None]
    assert len(given) == 1 and res.outputs[0].prompt_logprobs is not None  # once, at first
    assert engine.model is not None
    model: torch.nn.Module = engine.model  # type: ignore[assignment]
    with torch.inference_mode():
        logp = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    (lps,) = given
    assert [lp.token_id for lp in lps] == prompt[1:]
    for i, lp in enumerate(lps):
        assert lp.logprob == pytest.approx(float(logp[i, prompt[i + 1]]), abs=1e-4)
        assert lp.rank == int((logp[i] > logp[i, prompt[i + 1]]).sum()) + 1
        top = logp[i].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
    # a sequence that does not ask gets none
    plain = await run(engine, SamplingParams(max_tokens=2, temperature=0.0), "plain-lp")
    assert all(o.prompt_logprobs is None for o in plain.outputs)


async def test_the_sim_gives_its_prompt_logprobs_only_where_logprobs_are_served() -> None:
    assert Feature.PROMPT_LOGPROBS not in SimEngine().limits().features
    eng = SimEngine(logprobs=True, decode_base=0.0, prefill_base=0.0, prefill_per_token=0.0)
    await eng.start()
    try:
        prompt = eng.tokenizer.encode("hello")
        eng.add(EngineRequest("p", prompt, SamplingParams(max_tokens=2, prompt_logprobs=2)))
        out = (await collect(eng, 1))["p"]
        lps = out.outputs[0].prompt_logprobs
        assert lps is not None and [lp.token_id for lp in lps] == prompt[1:]
        assert all(len(lp.top) == 2 and lp.rank >= 1 for lp in lps)
    finally:
        await eng.stop()
