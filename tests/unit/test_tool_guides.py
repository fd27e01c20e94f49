"""The decoding guides of `tool_choice` required and named, compiled by xgrammar as the hf
engine does, and sampled at random under their masks with the tiny tokenizer: every text
they allow reads back (through the gateway's parsers) as calls whose arguments validate."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tokenyard.engines.guide import json_schema_grammar
from tokenyard.gateway.tools import parse_whole, read_tools, tool_call_stream

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("transformers")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
ALARM = {
    "type": "object",
    "properties": {"on": {"type": "boolean"}, "label": {"type": "string", "maxLength": 6}},
    "required": ["on"],
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM}},
]
SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}


@pytest.fixture(scope="module")
def compiler() -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    from tokenyard.engines.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model(tools=True))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    return xgr.GrammarCompiler(info), tokenizer


def _sample(compiled: Any, tokenizer: Any, seed: int, limit: int = 3000) -> str:
    """A random text the grammar allows: the end as soon as it is allowed, else any allowed
    token, whitespace seldom (the grammar allows it anywhere: a uniform walk would not end)."""
    rng = random.Random(seed)
    matcher = xgr.GrammarMatcher(compiled)
    vocab = compiled.tokenizer_info.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    blank = {i for i in range(vocab) if not tokenizer.decode([i]).strip()}
    ids: list[int] = []
    for _ in range(limit):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.zeros(vocab)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        allowed = torch.nonzero(logits != float("-inf")).flatten().tolist()
        if tokenizer.eos_token_id in allowed:
            pick = tokenizer.eos_token_id
        else:
            weights = [0.02 if i in blank else 1.0 for i in allowed]
            pick = rng.choices(allowed, weights)[0]
        assert matcher.accept_token(pick)
        if pick != tokenizer.eos_token_id:
            ids.append(pick)
    assert matcher.is_terminated(), "the sample did not end"
    text: str = tokenizer.decode(ids)
    return text


@pytest.mark.parametrize("parallel", [True, False])
def test_required_guides_allow_only_valid_calls(compiler: tuple[Any, Any], parallel: bool) -> None:
    grammar_compiler, tokenizer = compiler
    guide = read_tools(TOOLS, "required", parallel).guide()
    assert guide is not None and guide.json is not None
    compiled = grammar_compiler.compile_grammar(json_schema_grammar(guide.json))
    for seed in range(20):
        text = _sample(compiled, tokenizer, seed)
        parsed = parse_whole(tool_call_stream("required"), text)
        assert parsed.calls, text
        assert parallel or len(parsed.calls) == 1
        for call in parsed.calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_named_guides_allow_only_the_functions_arguments(compiler: tuple[Any, Any]) -> None:
    grammar_compiler, tokenizer = compiler
    choice = {"type": "function", "function": {"name": "set_alarm"}}
    guide = read_tools(TOOLS, choice, None).guide()
    assert guide is not None and guide.json is not None
    compiled = grammar_compiler.compile_grammar(json_schema_grammar(guide.json))
    for seed in range(20):
        text = _sample(compiled, tokenizer, seed)
        parsed = parse_whole(tool_call_stream("", named="set_alarm"), text)
        assert [c.name for c in parsed.calls] == ["set_alarm"]
        jsonschema.validate(json.loads(parsed.calls[0].arguments), ALARM)
