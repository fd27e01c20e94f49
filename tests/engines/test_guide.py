"""Compiling structured outputs (xgrammar) for the tiny model's tokenizer: literal choices,
strict JSON strings, one compilation per guide, and the compile deadline."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")

import xgrammar as xgr

from tokenyard.engines.guide import GuideCompiler, choice_grammar, json_schema_grammar
from tokenyard.engines.hf_tokenizer import load_hf_tokenizer
from tokenyard.errors import EngineError, InvalidRequest
from tokenyard.messages import Guide


@pytest.fixture(scope="module")
def compiler(tiny_model_path: Path) -> GuideCompiler:
    tok = load_hf_tokenizer(tiny_model_path)
    return GuideCompiler(tok.hf, vocab_size=1024, stop_token_ids=tok.eos_token_ids)


def accepts(compiler: GuideCompiler, guide: Guide, text: str) -> bool:
    """Whether the guide's grammar accepts exactly `text` (and may end there)."""
    matcher = xgr.GrammarMatcher(compiler.compile(guide))
    return bool(matcher.accept_string(text)) and bool(matcher.is_completed())


def test_choices_are_matched_literally(compiler: GuideCompiler) -> None:
    choices = ('a "quoted" \\ word', "(.*)", "é\n", "")
    assert choice_grammar(choices).startswith("root ::= ")
    guide = Guide(choice=choices)
    for c in choices:
        assert accepts(compiler, guide, c)
    assert not accepts(compiler, guide, "anything")


def test_json_strings_refuse_raw_control_characters(compiler: GuideCompiler) -> None:
    schema = json.dumps({"type": "string", "maxLength": 4})
    assert "\\x1f" in json_schema_grammar(schema)
    guide = Guide(json=schema)
    assert accepts(compiler, guide, '"ab"')
    assert not accepts(compiler, guide, '"a\x15"')
    assert not accepts(compiler, guide, '"abcde"')


def test_json_strings_refuse_utf8_surrogates(
    compiler: GuideCompiler, tiny_model_path: Path
) -> None:
    """ED B0 94 (a surrogate's 3-byte form, not UTF-8) decodes as three U+FFFD: refused."""
    hf = load_hf_tokenizer(tiny_model_path).hf
    quote, ed, b0_94 = hf.convert_tokens_to_ids(['"', "í", "°Ķ"])
    assert hf.decode([ed, b0_94]) == "\ufffd" * 3
    for schema in ({"type": "string", "maxLength": 4}, {"type": "string"}):
        matcher = xgr.GrammarMatcher(compiler.compile(Guide(json=json.dumps(schema))))
        assert matcher.accept_token(quote) and matcher.accept_token(ed)
        assert not matcher.accept_token(b0_94)


def test_json_object_is_an_object(compiler: GuideCompiler) -> None:
    guide = Guide(json_object=True)
    assert accepts(compiler, guide, '{"a": [1, {"b": null}]}')
    assert not accepts(compiler, guide, "[]")


def test_a_guide_compiles_once(compiler: GuideCompiler) -> None:
    guide = Guide(regex="[0-9]{3}")
    assert compiler.compile(guide) is compiler.compile(guide)


def test_a_slow_compile_fails_the_attempt_and_finishes_for_later(tiny_model_path: Path) -> None:
    tok = load_hf_tokenizer(tiny_model_path)
    slow = GuideCompiler(tok.hf, vocab_size=1024, stop_token_ids=tok.eos_token_ids, timeout=0.2)
    release = threading.Event()
    compile_now = slow._compile_now

    def stuck(guide: Guide, kind: str) -> xgr.CompiledGrammar:
        release.wait(10)
        return compile_now(guide, kind)

    slow._compile_now = stuck  # type: ignore[method-assign]
    guide = Guide(regex="x+")
    # the server's slowness, not the client's fault: retried (EngineError), not a 400
    with pytest.raises(EngineError, match="did not compile within") as err:
        slow.compile(guide)
    assert not isinstance(err.value, InvalidRequest)
    # the window is spent: the next caller (add, after the worker's ready_for) does not wait
    began = time.monotonic()
    with pytest.raises(EngineError):
        slow.compile(guide)
    assert time.monotonic() - began < 0.1
    # a retry's first wait (off the loop) gets a fresh window
    began = time.monotonic()
    with pytest.raises(EngineError):
        slow.compile(guide, fresh_window=True)
    assert time.monotonic() - began >= 0.15
    # other guides still compile meanwhile (another worker), and the stuck one completes later
    slow._compile_now = compile_now  # type: ignore[method-assign]
    assert slow.compile(Guide(regex="y+")) is not None
    release.set()
    assert slow.compile(guide, fresh_window=True) is not None
    assert slow.compile(guide) is not None
    slow.close()
