"""Incremental detokenizer, stop-string matcher and per-sequence decoder (pure)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tokenyard.engines.detok import (
    REPLACEMENT,
    IncrementalDetokenizer,
    SequenceDecoder,
    StopMatcher,
)
from tokenyard.engines.sim import SimTokenizer
from tokenyard.messages import FinishReason, SamplingParams

TOK = SimTokenizer()  # byte-level: every UTF-8 byte is its own token
EOS = SimTokenizer.EOS


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def stream(detok: IncrementalDetokenizer, tokens: list[int]) -> list[str]:
    return [detok.push([t]) for t in tokens]


def test_multibyte_character_split_across_tokens_is_held_back() -> None:
    detok = IncrementalDetokenizer(TOK.decode)
    pieces = stream(detok, ids("aé🚀b"))
    # "é" is 2 bytes and "🚀" 4: nothing is emitted until the last byte of each arrives.
    assert pieces == ["a", "", "é", "", "", "", "🚀", "b"]
    assert all(REPLACEMENT not in p for p in pieces)


def test_several_tokens_per_push_and_flush_of_truncated_character() -> None:
    detok = IncrementalDetokenizer(TOK.decode)
    data = ids("日本")
    assert detok.push(data[:4]) == "日"  # second character still incomplete
    assert detok.push(data[4:5]) == ""
    # The sequence ends mid-character: flush releases what there is, as a replacement char.
    assert detok.flush() == REPLACEMENT


def test_invalid_bytes_are_emitted_once_followed_by_valid_text() -> None:
    detok = IncrementalDetokenizer(TOK.decode)
    lone = 0x80 + SimTokenizer.OFFSET  # a stray continuation byte can never complete
    assert detok.push([lone]) == ""
    assert detok.push(ids("x")) == REPLACEMENT + "x"


def test_random_splits_reassemble_exactly() -> None:
    rng = random.Random(0)
    text = "naïve café — 你好, мир! 🚀🎉 ok"
    data = ids(text)
    for _ in range(200):
        detok = IncrementalDetokenizer(TOK.decode, prompt_ids=ids("prompt "))
        out, i = [], 0
        while i < len(data):
            n = rng.randint(1, 4)
            piece = detok.push(data[i : i + n])
            assert not piece.endswith(REPLACEMENT)
            out.append(piece)
            i += n
        out.append(detok.flush())
        assert "".join(out) == text


def test_stop_string_split_across_steps() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.held == "ST"
    assert m.feed("O") == ("", False)
    assert m.feed("P tail") == ("", True)


def test_held_prefix_released_when_it_does_not_match() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("x S") == ("x ", False)
    assert m.feed("Tx") == ("STx", False)
    assert m.held == ""
    assert m.feed("ST") == ("", False)
    assert m.flush() == "ST"


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["world", "lo w", "\n\n"])
    assert m.feed("hello world") == ("hel", True)


def test_overlapping_prefix_is_held() -> None:
    m = StopMatcher(["aab"])
    assert m.feed("xaa") == ("x", False)
    assert m.feed("a") == ("a", False)  # "aaa": only the last "aa" can still start "aab"
    assert m.feed("b") == ("", True)


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher([])
    assert m.feed("anything") == ("anything", False)


def decoder(
    params: SamplingParams, resume: list[int] | None = None, **kw: object
) -> SequenceDecoder:
    return SequenceDecoder(
        TOK.decode,
        params,
        prompt_ids=ids("hi "),
        eos_token_ids=(EOS,),
        resume_ids=resume or [],
        **kw,  # type: ignore[arg-type]
    )


def run(dec: SequenceDecoder, tokens: list[int]) -> tuple[str, list[int], FinishReason | None]:
    text, taken = "", []
    for t in tokens:
        d = dec.feed([t])
        text += d.text
        taken += d.token_ids
        if d.finish_reason is not None:
            return text, taken, d.finish_reason
    return text, taken, None


def test_decoder_stop_string_across_tokens_is_not_emitted() -> None:
    dec = decoder(SamplingParams(max_tokens=50, stop=("END",)))
    text, taken, reason = run(dec, ids("one two EN") + ids("D three"))
    assert (text, reason) == ("one two ", FinishReason.STOP)
    assert len(taken) == len("one two END") and dec.completion_tokens == len(taken)


def test_decoder_eos_and_ignore_eos() -> None:
    tokens = [*ids("ab"), EOS, *ids("cd")]
    assert run(decoder(SamplingParams(max_tokens=10)), tokens) == (
        "ab",
        tokens[:3],
        FinishReason.STOP,
    )
    dec = decoder(SamplingParams(max_tokens=4, ignore_eos=True))
    text, taken, reason = run(dec, tokens)
    assert (text, taken, reason) == ("abc", tokens[:4], FinishReason.LENGTH)


def test_decoder_length_flushes_held_text() -> None:
    dec = decoder(SamplingParams(max_tokens=3, stop=("xyz",)))
    # "x" is held as a possible stop start, then released when the length limit ends the sequence.
    assert run(dec, ids("abx")) == ("abx", ids("abx"), FinishReason.LENGTH)


def test_decoder_limit_caps_max_tokens() -> None:
    dec = decoder(SamplingParams(max_tokens=100), limit=2)
    assert dec.limit == 2
    assert run(dec, ids("abc"))[2] is FinishReason.LENGTH


def test_decoder_close_releases_held_text() -> None:
    dec = decoder(SamplingParams(max_tokens=100, stop=("!!",)))
    assert dec.feed(ids("hey!")).text == "hey"
    d = dec.close(FinishReason.LENGTH)
    assert (d.text, d.finish_reason) == ("!", FinishReason.LENGTH)


@pytest.mark.parametrize("seed", range(20))
def test_resume_continues_text_exactly(seed: int) -> None:
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=60, stop=("<<STOP>>", "é!"))
    body = "ab é日本 🚀 x <<ST y <<STOP>> z"
    tokens = ids(body)
    full_text, full_taken, full_reason = run(decoder(params), tokens)
    k = rng.randint(1, len(full_taken) - 1)
    # What the first attempt had emitted after k tokens (the held-back tail is not included).
    first = decoder(params)
    emitted_k = "".join(first.feed([t]).text for t in tokens[:k])
    resumed = decoder(params, resume=tokens[:k])
    assert resumed.completion_tokens == k
    rest_text, rest_taken, rest_reason = run(resumed, tokens[k:])
    assert emitted_k + rest_text == full_text
    assert tokens[:k] + rest_taken == full_taken
    assert rest_reason == full_reason == FinishReason.STOP
    assert resumed.completion_tokens == len(full_taken)


def test_resume_that_already_finished() -> None:
    params = SamplingParams(max_tokens=3)
    assert decoder(params, resume=ids("abc")).finish_reason is FinishReason.LENGTH
    assert decoder(SamplingParams(), resume=[*ids("a"), EOS]).finish_reason is FinishReason.STOP
    stop = SamplingParams(max_tokens=10, stop=("bc",))
    assert decoder(stop, resume=ids("abc")).finish_reason is FinishReason.STOP


def test_resume_mid_character_emits_the_character_once() -> None:
    e_acute = ids("é")
    resumed = IncrementalDetokenizer(
        TOK.decode, prompt_ids=ids("p"), resume_ids=[*ids("a"), e_acute[0]]
    )
    assert resumed.resumed_text == "a"
    assert resumed.push(e_acute[1:]) == "é"
    assert resumed.push(ids("z")) == "z"


def test_decoder_stop_token_ids_end_like_eos_even_with_ignore_eos() -> None:
    stop_id = ids("x")[0]
    tokens = [*ids("ab"), stop_id, *ids("cd")]
    for ignore_eos in (False, True):
        params = SamplingParams(max_tokens=10, stop_token_ids=(stop_id,), ignore_eos=ignore_eos)
        # the stop token is in the token ids, not in the text
        assert run(decoder(params), tokens) == ("ab", tokens[:3], FinishReason.STOP)


def test_decoder_min_tokens_holds_eos_and_stop_token_ids_back() -> None:
    stop_id = ids("x")[0]
    tokens = [EOS, stop_id, *ids("a"), EOS, *ids("b")]
    params = SamplingParams(max_tokens=10, min_tokens=3, stop_token_ids=(stop_id,))
    # The first two end nothing (fewer than min_tokens so far); the 4th token, EOS, does.
    text, taken, reason = run(decoder(params), tokens)
    assert (taken, reason) == (tokens[:4], FinishReason.STOP)
    assert text.endswith("a")
    assert decoder(params, resume=[EOS]).finish_reason is None
    assert decoder(params, resume=[*ids("ab"), EOS]).finish_reason is FinishReason.STOP


def run_in_reads(
    dec: SequenceDecoder, tokens: list[int], sizes: list[int]
) -> tuple[str, list[int], FinishReason | None]:
    """Feed `tokens` in runs of the given sizes (an upstream's reads), until a finish."""
    text, taken, i = "", [], 0
    for size in sizes:
        d = dec.feed(tokens[i : i + size])
        i += size
        text += d.text
        taken += d.token_ids
        if d.finish_reason is not None:
            return text, taken, d.finish_reason
    return text, taken, None


@pytest.mark.parametrize("seed", range(4))
def test_runs_fed_together_match_one_token_at_a_time(seed: int) -> None:
    # without stop strings a run is decoded in one push: the same text, tokens and finish as
    # token by token, across split characters, EOS inside a run and the limit inside a run
    rng = random.Random(seed)
    body = ids("naïve café — 你好, мир! 🚀 ok ") * 2
    cases = [
        (SamplingParams(max_tokens=200), body),
        (SamplingParams(max_tokens=200), [*body[:17], EOS, *body[17:]]),
        (SamplingParams(max_tokens=200, min_tokens=30), [*body[:17], EOS, *body[17:40], EOS]),
        (SamplingParams(max_tokens=23), body),
        (SamplingParams(max_tokens=23, ignore_eos=True), [*body[:9], EOS, *body[9:]]),
        (SamplingParams(max_tokens=200, stop=("мир",)), body),
    ]
    for params, tokens in cases:
        sizes = []
        while sum(sizes) < len(tokens):
            sizes.append(rng.randint(1, 9))
        together = run_in_reads(decoder(params), tokens, sizes)
        assert together == run(decoder(params), tokens), params


class CountedDecode:
    """The test tokenizer's decode, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, token_ids: Sequence[int]) -> str:
        self.calls += 1
        return TOK.decode(token_ids)


def test_a_run_without_stop_strings_is_decoded_once() -> None:
    counted = CountedDecode()
    dec = SequenceDecoder(counted, SamplingParams(max_tokens=100), prompt_ids=ids("hi "))
    before = counted.calls
    delta = dec.feed(ids("eight tokens"))
    assert delta.text == "eight tokens"
    assert counted.calls - before == 2  # the run's window and what of it was already out


def test_a_fresh_sequence_decodes_nothing_before_its_first_tokens() -> None:
    counted = CountedDecode()
    dec = SequenceDecoder(counted, SamplingParams(max_tokens=100), prompt_ids=ids("hi "))
    assert counted.calls == 0
    assert dec.feed(ids("a")).text == "a"
    resumed = SequenceDecoder(
        counted, SamplingParams(max_tokens=100), prompt_ids=ids("hi "), resume_ids=ids("ab")
    )
    assert resumed.feed(ids("c")).text == "c"  # the resumed tokens' text was out already
