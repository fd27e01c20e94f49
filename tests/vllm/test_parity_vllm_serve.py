"""The requests today's applications send, to `vllm serve` and to tokenyard (gateway + a
worker on the vLLM engine) on the same model directory: the answers have the same shape,
field by field (keys and JSON types, not values), and where decoding is greedy the same text.

Shapes are compared over OpenAI's fields: vLLM's own extras (stop_reason, token_ids,
prompt_logprobs, ...) and per-response values (id, created, fingerprints) are left out, and a
field one side sends as null or [] the other may leave out.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytest.importorskip("vllm")

import jsonschema

from tests.engines.upstream import process
from tests.gateway.conftest import Stack, run_stack
from tests.vllm.test_remote_vllm import vllm_serve_command
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.engines.tiny import ensure_tiny_model
from tokenyard.fleet.launch import free_port, wait_ready

pytestmark = pytest.mark.slow

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ann", "bob"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CHAT = [{"role": "user", "content": "Tell me about the yard."}]

# (endpoint, body, greedy: the two texts must be equal too)
REQUESTS: dict[str, tuple[str, dict[str, Any], bool]] = {
    "chat_logprobs": (
        "chat/completions",
        {"messages": CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 3},
        True,
    ),
    "chat_logprobs_only_chosen": (
        "chat/completions",
        {"messages": CHAT, "max_tokens": 4, "temperature": 0, "logprobs": True},
        True,
    ),
    "completions_logprobs": (
        "completions",
        {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "logprobs": 3},
        True,
    ),
    "completions_echo": (
        "completions",
        {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "echo": True},
        True,
    ),
    "completions_logprobs_echo": (
        "completions",
        {
            "prompt": "Once upon a time",
            "max_tokens": 4,
            "temperature": 0,
            "logprobs": 2,
            "echo": True,
        },
        True,
    ),
    "chat_json_schema": (
        "chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 60,
            "temperature": 0,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
            },
        },
        True,
    ),
    "chat_json_object": (
        "chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 40,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
        True,
    ),
    "chat_n2_seed": (
        "chat/completions",
        {"messages": CHAT, "max_tokens": 6, "n": 2, "seed": 7, "temperature": 0.9},
        False,
    ),
    "completions_penalties": (
        "completions",
        {
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "temperature": 0,
            "presence_penalty": 1.0,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.3,
        },
        True,
    ),
    "chat_logit_bias": (
        "chat/completions",
        {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logit_bias": {"42": 100}},
        True,
    ),
    "completions_min_tokens_stop_ids": (
        "completions",
        {
            "prompt": "Once upon a time",
            "max_tokens": 12,
            "temperature": 0,
            "min_tokens": 3,
            "stop_token_ids": [42],
            "logit_bias": {"42": 100},
        },
        True,
    ),
    # vLLM's extra fields, as the openai client's extra_body sends them
    "completions_vllm_extras": (
        "completions",
        {
            "prompt": "Once upon a time there was a yard",
            "max_tokens": 10,
            "temperature": 0,
            "top_k": -1,
            "min_p": 0.1,
            "allowed_token_ids": list(range(50, 600)),
            "bad_words": ["the", "yard"],
            "truncate_prompt_tokens": 5,
            "add_special_tokens": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True,
            "cache_salt": "a-salt",
            "priority": 0,
            "logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
        True,
    ),
    "chat_vllm_extras": (
        "chat/completions",
        {
            "messages": [*CHAT, {"role": "assistant", "content": "The yard"}],
            "max_tokens": 8,
            "temperature": 0,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "add_special_tokens": False,
            "logprobs": True,
            "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
        True,
    ),
    "completions_prompt_logprobs": (
        "completions",
        {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2},
        True,
    ),
    "completions_batched": (
        "completions",
        {"prompt": ["Once upon a time", "The yard"], "max_tokens": 6, "temperature": 0},
        True,
    ),
    "completions_batched_n2": (
        "completions",
        # vLLM takes a list of strings or of token-id lists, not the two mixed (tokenyard does)
        {"prompt": [[9, 10, 11], [5, 6, 7]], "max_tokens": 6, "n": 2, "seed": 7},
        False,
    ),
}

# per-response values, and what vLLM adds beyond OpenAI's schema
IGNORED = {
    "id",
    "created",
    "system_fingerprint",
    "service_tier",
    "stop_reason",
    "token_ids",
    "prompt_token_ids",
    "prompt_logprobs",
    "kv_transfer_params",
    "reasoning",
    "reasoning_content",
    "metrics",
    "prompt_tokens_details",
    "completion_tokens_details",
}


def shape(value: Any, key: str = "") -> Any:
    """A JSON value's shape: objects by key, scalars by type, an array by the union of its
    elements' shapes (so a field null in one element only still counts as its type); a
    completions `top_logprobs` entry (token -> logprob) as a mapping, whatever its tokens."""
    if isinstance(value, dict):
        if key == "top_logprobs_entry" and not {"token", "logprob"} <= set(value):
            return {"<token>": union([shape(v) for v in value.values()])}
        return {k: shape(v, k) for k, v in value.items() if k not in IGNORED and not empty(v)}
    if isinstance(value, list):
        inner = "top_logprobs_entry" if key == "top_logprobs" else ""
        return ["list", union([shape(v, inner) for v in value if not empty(v)])]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "null"


def union(shapes: list[Any]) -> Any:
    """One shape for values seen in the same place: objects merged key by key, arrays by
    their elements, anything else as the sorted set of what was seen."""
    if not shapes:
        return None
    if all(isinstance(s, dict) for s in shapes):
        keys = sorted({k for s in shapes for k in s})
        return {k: union([s[k] for s in shapes if k in s]) for k in keys}
    if all(isinstance(s, list) for s in shapes):
        return ["list", union([s[1] for s in shapes if s[1] is not None])]
    seen = sorted({json.dumps(s, sort_keys=True) for s in shapes})
    return json.loads(seen[0]) if len(seen) == 1 else [json.loads(x) for x in seen]


def empty(value: Any) -> bool:
    return value is None or value == []


def differences(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Where two shapes differ, by path: what the assertion message shows."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        out = []
        for key in sorted(set(ours) | set(theirs)):
            if key not in ours:
                out.append(f"{path}.{key}: only vLLM's ({theirs[key]})")
            elif key not in theirs:
                out.append(f"{path}.{key}: only tokenyard's ({ours[key]})")
            else:
                out += differences(ours[key], theirs[key], f"{path}.{key}")
        return out
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        pairs = enumerate(zip(ours, theirs, strict=True))
        return [d for i, (a, b) in pairs for d in differences(a, b, f"{path}[{i}]")]
    return [] if ours == theirs else [f"{path}: tokenyard {ours} != vLLM {theirs}"]


@pytest.fixture(scope="module")
def serve() -> Iterator[str]:
    port = free_port()
    # eager on both sides: the same numerics, and a start that fits run_stack's minute (the
    # engine's start holds the stack's loop; `yard` comes first, with the CPU to itself)
    cmd = [*vllm_serve_command(ensure_tiny_model(head_dim=32), port), "--enforce-eager"]
    with process(cmd, f"http://127.0.0.1:{port}", "/v1/models", 300) as url:
        yield url


@pytest.fixture(scope="module")
def yard(valkey: EmbeddedServer) -> Iterator[Stack]:
    from tokenyard.engines import make_engine
    from tokenyard.gateway.tokenizers import load_tokenizer

    path = str(ensure_tiny_model(head_dim=32))
    with run_stack(
        valkey,
        model=MODEL,
        tokenizer=load_tokenizer("hf", path),
        engines=[
            lambda: make_engine(
                "vllm", model="tiny", max_seqs=8, max_model_len=2048, enforce_eager=True
            )
        ],
        worker_options={"engine": "vllm"},
        start_timeout_s=300,
    ) as stack:
        wait_ready(stack.url + "/readyz", timeout_s=300, interval_s=0.1)
        yield stack


def post(base: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{base}/v1/{endpoint}", json={"model": MODEL, **body}, timeout=300)
    assert r.status_code == 200, (base, r.text)
    answer: dict[str, Any] = r.json()
    return answer


def texts(answer: dict[str, Any]) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in answer["choices"]]


# what tokenyard does not answer as vLLM does, and why
KNOWN_GAPS = {
    # bytes of a character the stop token cut short: vLLM leaves them out of the text,
    # tokenyard's decoder flushes them as U+FFFD (engines/detok.py, SequenceDecoder._close_text)
    "completions_min_tokens_stop_ids": "a cut-short character's bytes flushed as U+FFFD",
    # the same at max_tokens: the second prompt's answer ends inside a character
    "completions_batched": "a cut-short character's bytes flushed as U+FFFD",
}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(reason=KNOWN_GAPS[n], strict=True))
        if n in KNOWN_GAPS
        else n
        for n in REQUESTS
    ],
)
def test_same_shape_as_vllm_serve(yard: Stack, serve: str, name: str) -> None:
    endpoint, body, greedy = REQUESTS[name]
    theirs = post(serve, endpoint, body)
    ours = post(yard.url, endpoint, body)
    assert shape(ours) == shape(theirs), differences(shape(ours), shape(theirs))
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    assert len(ours["choices"]) == prompts * body.get("n", 1)
    assert [c["index"] for c in ours["choices"]] == [c["index"] for c in theirs["choices"]]
    if greedy:
        assert texts(ours) == texts(theirs)
    if "response_format" in body:
        for text in texts(ours):
            value = json.loads(text)
            if body["response_format"]["type"] == "json_schema":
                jsonschema.validate(value, SCHEMA)
            else:
                assert isinstance(value, dict)


def stream_shape(base: str, body: dict[str, Any]) -> Any:
    """A streamed chat answer's chunks as one shape: every field any chunk carries."""
    shapes = []
    with httpx.stream(
        "POST",
        f"{base}/v1/chat/completions",
        json={"model": MODEL, **body, "stream": True},
        timeout=300,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                shapes.append(shape(json.loads(line[5:])))
    return union(shapes)


def test_streamed_logprobs_have_the_same_shape(yard: Stack, serve: str) -> None:
    body = {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True}
    body |= {"top_logprobs": 2, "stream_options": {"include_usage": True}}
    theirs = stream_shape(serve, body)
    ours = stream_shape(yard.url, body)
    # every field vLLM's chunks carry (role, content with logprobs, finish, usage), the same
    assert ours == theirs, differences(ours, theirs)


# vLLM's /tokenize bodies: a prompt, or messages through the chat template with its switches
TOKENIZE: dict[str, dict[str, Any]] = {
    "prompt": {"prompt": "Once upon a time, the yard"},
    "prompt_bare_with_pieces": {
        "prompt": "Once upon a time, the yard",
        "add_special_tokens": False,
        "return_token_strs": True,
    },
    "messages": {"messages": CHAT, "return_token_strs": True},
    "messages_no_generation_prompt": {"messages": CHAT, "add_generation_prompt": False},
    "messages_continued": {
        "messages": [*CHAT, {"role": "assistant", "content": "The yard"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    "messages_special_and_kwargs": {
        "messages": CHAT,
        "add_special_tokens": True,
        "chat_template_kwargs": {"unused_variable": 1},
    },
}


@pytest.mark.parametrize("name", list(TOKENIZE))
def test_tokenize_answers_as_vllm_serve(yard: Stack, serve: str, name: str) -> None:
    """The same ids (and pieces, and context) for the same body: tokenyard's gateway renders
    and tokenizes as vLLM's server does, without a job."""
    body = {"model": MODEL, **TOKENIZE[name]}
    theirs = httpx.post(f"{serve}/tokenize", json=body, timeout=60)
    ours = httpx.post(f"{yard.url}/tokenize", json=body, timeout=60)
    assert theirs.status_code == ours.status_code == 200, (theirs.text, ours.text)
    assert ours.json() == theirs.json()
    # and back: /detokenize of those ids
    ids = {"model": MODEL, "tokens": theirs.json()["tokens"]}
    back = [httpx.post(f"{base}/detokenize", json=ids, timeout=60) for base in (serve, yard.url)]
    assert back[0].status_code == back[1].status_code == 200
    assert back[1].json() == back[0].json()
