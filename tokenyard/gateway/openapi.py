"""The OpenAPI document says what the server does: the request bodies the routes really
validate (they read raw bytes, so FastAPI cannot see them), every status each route can answer
with OpenAI's error shape; `/openapi.json`, `/docs` and `/redoc` need a key like the API unless
`docs_public` (the default) opens them to browsers.

Routes name their own statuses (`answers(...)`) and bodies (`json_body(...)`); `install` adds
what every operation shares (400 for a bad parameter, 401 and 503 from the key lookup, 413 for
a body) and drops FastAPI's 422, which this server never sends (invalid input is 400, as OpenAI
answers). What JSON Schema cannot say is in the descriptions: a prompt and its `max_tokens` must
fit the model's context, token ids its vocabulary, and a `deadline` must lie in the future.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse

from tokenyard.gateway.anthropic import STOP_SEQUENCES_MAX, TOOL_NAME
from tokenyard.gateway.auth import authenticate
from tokenyard.gateway.batches.types import ENDPOINTS
from tokenyard.gateway.errors import anthropic_path
from tokenyard.gateway.protocol import MAX_EMBEDDING_INPUTS, TEMPLATE_ARGUMENTS, VLLM_ONLY
from tokenyard.gateway.settings import GatewaySettings
from tokenyard.gateway.state import gateway
from tokenyard.gateway.tools.request import MAX_TOOLS
from tokenyard.limits import DEADLINE_MIN, MAX_CACHE_SALT, MAX_LOGPROBS
from tokenyard.messages import Feature

INT64 = {"type": "integer", "minimum": -(1 << 63), "maximum": (1 << 63) - 1}

_REASONS = {
    400: "Invalid request: a parameter's value, malformed JSON, an unsupported field",
    401: "No API key, or an unknown or revoked one (when keys are configured)",
    403: "The route needs an admin API key",
    404: "No such model, job, file or batch (another tenant's is as invisible as none)",
    405: "Method not allowed on this path (Allow names the ones that are)",
    409: "Conflict with the resource's state",
    413: "The request body is larger than the gateway admits",
    429: "Rate limited: the tenant's quota, a full queue, or an estimated queue wait past the "
    "deadline or the queue-wait SLO (Retry-After says when to retry, where a retry can pass)",
    499: "The client closed the request",
    500: "The job failed on every attempt",
    503: "The broker is unavailable, the job expired in the queue, or not ready",
    504: "The request timed out",
    529: "Overloaded: the broker is unavailable or the job expired in the queue (Anthropic's "
    "status for what the other APIs answer 503)",
}


def _object(
    properties: dict[str, Any], required: Sequence[str] = (), *, closed: bool = False
) -> dict[str, Any]:
    """An object of these fields, `required` of them needed. `closed` admits no other field:
    a request body's unknown or misspelt field is a 400 naming it, not a field ignored."""
    schema: dict[str, Any] = {"type": "object"}
    if required:
        schema["required"] = list(required)
    if closed:
        schema["additionalProperties"] = False
    schema["properties"] = properties
    return schema


def _tagged(
    kind: str, properties: dict[str, Any], required: Sequence[str] = (), *, closed: bool = False
) -> dict[str, Any]:
    """One member of a union its `type` names (a response format, a tool, an input item): the
    name is required, so a body matches one member at most."""
    return _object({"type": {"const": kind}, **properties}, ["type", *required], closed=closed)


def _error_ref() -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}


def answers(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error statuses a route answers besides the shared ones, as FastAPI `responses`."""
    return {s: {"description": _REASONS[s], "content": _error_ref()} for s in statuses}


# each server-sent event, as a client parses it
SSE = {
    "text/event-stream": {
        "schema": _object(
            {
                "data": {"type": "string"},
                "id": {"type": "string"},
                "event": {"type": "string"},
            },
            ["data"],
        )
    }
}


def json_body(schema: str) -> dict[str, Any]:
    """`openapi_extra` for a route that reads a JSON body of the named component itself."""
    ref = {"$ref": f"#/components/schemas/{schema}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


ERROR = _object(
    {
        "error": _object(
            {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            ["message", "type", "param", "code"],
        )
    },
    ["error"],
)


# Anthropic's error shape, which its API's paths answer (`errors.anthropic_path`)
ANTHROPIC_ERROR = _tagged(
    "error",
    {
        "error": _object(
            {"type": {"type": "string"}, "message": {"type": "string"}},
            ["type", "message"],
        ),
    },
    ["error"],
)


def _vllm_fields(feature: str) -> dict[str, Any]:
    """vLLM's extra fields of both routes: those served, and those refused unless neutral."""
    neutral = {
        # 1 and 1.0 are one JSON value
        name: {"enum": list(dict.fromkeys(values)), "description": f"Not supported {why}"}
        for name, (values, why) in VLLM_ONLY.items()
    }
    return {
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1, "description": feature}),
        "allowed_token_ids": _nullable(
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0},
                "description": "token ids in the model's vocabulary; " + feature,
            }
        ),
        "bad_words": _nullable(
            {
                "type": "array",
                "items": {"type": "string", "pattern": "\\S"},
                "description": feature,
            }
        ),
        "include_stop_str_in_output": {"type": "boolean", "default": False},
        "skip_special_tokens": {"type": "boolean", "default": True},
        "spaces_between_special_tokens": {"type": "boolean", "default": True},
        "truncate_prompt_tokens": _nullable(
            {
                "anyOf": [{"const": -1}, {**INT64, "minimum": 1}],
                "description": "keep the prompt's last (truncation_side left) or first N "
                "tokens; -1: the model's context",
            }
        ),
        "truncation_side": _nullable({"enum": ["left", "right"]}),
        "add_special_tokens": _nullable({"type": "boolean"}),
        "prompt_logprobs": _nullable(
            {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_LOGPROBS,
                "description": "not above 0 with stream; " + feature,
            }
        ),
        "return_tokens_as_token_ids": _nullable({"type": "boolean"}),
        "cache_salt": _nullable(
            {"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT, "description": feature}
        ),
        **neutral,
    }


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _neutral(*values: Any) -> dict[str, Any]:
    # a field OpenAI defines that this server refuses unless it holds its neutral value
    return {"enum": list(values), "description": "Not supported; only its neutral value"}


@dataclass(frozen=True)
class Served:
    """What the models behind the names a request may give can do, as their workers publish
    it: the names whose model embeds, and for each optional decoding feature the names whose
    model's engine lacks it (a request asking it of one is 400)."""

    embedders: frozenset[str]
    lacking: frozenset[tuple[Feature, str]] = frozenset()
    scorers: frozenset[str] | None = None  # the names whose model scores (None: not known)


# each optional feature's request fields (completions, chat) and the values that ask nothing
_NEUTRAL: dict[Feature, dict[str, dict[str, Any]]] = {
    Feature.PENALTIES: {
        "presence_penalty": {"enum": [0, None]},
        "frequency_penalty": {"enum": [0, None]},
        "repetition_penalty": {"enum": [1, None]},
    },
    Feature.LOGIT_BIAS: {"logit_bias": {"anyOf": [{"type": "null"}, {"maxProperties": 0}]}},
    Feature.MIN_TOKENS: {"min_tokens": {"const": 0}},
    Feature.STOP_TOKEN_IDS: {"stop_token_ids": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}},
    Feature.MIN_P: {"min_p": {"enum": [0, None]}},
    Feature.ALLOWED_TOKEN_IDS: {
        "allowed_token_ids": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}
    },
    Feature.BAD_WORDS: {"bad_words": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}},
    Feature.DETOKENIZE: {
        "skip_special_tokens": {"const": True},
        "spaces_between_special_tokens": {"const": True},
        "include_stop_str_in_output": {"const": False},
    },
    Feature.CACHE_SALT: {"cache_salt": {"type": "null"}},
    Feature.PROMPT_LOGPROBS: {"prompt_logprobs": {"type": "null"}},
}
_NEUTRAL_LOGPROBS: dict[str, dict[str, Any]] = {
    "completion": {"type": "null"},
    "chat": {"const": False},
}


def _without_lacking(served: Served | None, kind: str) -> list[dict[str, Any]]:
    """Rules: a model whose engine lacks a feature takes only the neutral values of its fields
    (structured outputs, whose asking spans several fields, stays in the descriptions)."""
    rules: list[dict[str, Any]] = []
    for feature in Feature:
        names = sorted(n for f, n in (served.lacking if served else ()) if f is feature)
        neutral = dict(_NEUTRAL.get(feature, {}))
        if feature is Feature.LOGPROBS:
            neutral = {"logprobs": _NEUTRAL_LOGPROBS[kind]}
        if names and neutral:
            rules.append(
                {
                    "if": {"required": ["model"], "properties": {"model": {"enum": names}}},
                    "then": {"properties": neutral},
                }
            )
    return rules


def request_schemas(
    settings: GatewaySettings, models: Sequence[str], served: Served | None = None
) -> dict[str, dict[str, Any]]:
    """The request bodies, as the routes validate them under these settings; `models`: the
    names a request may give (served models and aliases; any other is 404); `served`: what
    their models can do (None: all of it, as before any worker said)."""
    embedders = None if served is None else served.embedders
    scorers = None if served is None else served.scorers
    max_tokens = {
        "type": "integer",
        "minimum": 1,
        "maximum": settings.max_tokens_cap,
        "description": "with the prompt, at most the model's context",
    }
    # what JSON Schema cannot say: a model's engine implements a feature or refuses it (400
    # naming the parameter and the engine); a constraint must compile (xgrammar), one at most
    feature = "refused (400) unless the model's engine implements it"
    guide = "one structured output constraint per request, which must compile; " + feature
    penalty = {"type": "number", "minimum": -2, "maximum": 2, "description": feature}
    response_format = {
        "oneOf": [
            _tagged("text", {}),
            _tagged("json_object", {}),
            _tagged(
                "json_schema",
                {
                    "json_schema": _object(
                        {
                            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                            "schema": {"type": ["object", "boolean"]},
                            "strict": {"type": ["boolean", "null"]},
                        },
                        ["name"],
                    ),
                },
                ["json_schema"],
            ),
        ],
        "description": "json_object or json_schema: " + guide,
    }
    # the Responses API's `text.format`: chat's response_format with the schema's fields flat
    text_format = {
        "oneOf": [
            *(_tagged(kind, {}, closed=True) for kind in ("text", "json_object")),
            _tagged(
                "json_schema",
                {
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "schema": {"type": ["object", "boolean"]},
                    "strict": {"type": ["boolean", "null"]},
                    "description": {"type": "string"},
                },
                ["name", "schema"],
                closed=True,
            ),
        ],
        "description": "json_object or json_schema: " + guide,
    }
    structured_outputs = {
        **_object(
            {
                "json": {"type": ["string", "object", "boolean", "null"]},
                "regex": {"type": ["string", "null"], "minLength": 1},
                "choice": {
                    "type": ["array", "null"],
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                },
                "grammar": {"type": ["string", "null"], "minLength": 1},
                "json_object": {"type": ["boolean", "null"]},
            },
        ),
        # vLLM's other switches (whitespace, backend, structural tags) only unset
        "additionalProperties": {"enum": [None, False, ""]},
        "description": "vLLM's: " + guide,
    }
    common: dict[str, Any] = {
        "model": {"enum": list(models)},
        "max_tokens": _nullable(max_tokens),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "n": {
            "type": "integer",
            "minimum": 1,
            "maximum": settings.max_n,
            "default": 1,
            "description": "choices, each its own job; 1 only on /v1/jobs and in batches",
        },
        "stream": {"type": "boolean", "default": False},
        "stream_options": _nullable(
            {
                **_object(
                    {"include_usage": {"type": "boolean"}},
                ),
                "description": "only with stream: true",
            }
        ),
        "stop": _nullable(
            {
                "anyOf": [
                    {"type": "string"},
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1},
                        "maxItems": 16,
                    },
                ]
            }
        ),
        "seed": _nullable(INT64),
        "user": _nullable({"type": "string"}),
        "presence_penalty": _nullable(penalty),
        "frequency_penalty": _nullable(penalty),
        "repetition_penalty": _nullable(
            {"type": "number", "exclusiveMinimum": 0, "maximum": 2, "description": feature}
        ),
        "logit_bias": _nullable(
            {
                "type": "object",
                "propertyNames": {"pattern": "^[+-]?[0-9]{1,19}$"},
                "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                "description": "token id (in the model's vocabulary) to bias; " + feature,
            }
        ),
        "min_tokens": {
            "type": "integer",
            "minimum": 0,
            "default": 0,
            "description": "at most max_tokens; " + feature,
        },
        "stop_token_ids": _nullable(
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0},
                "description": "token ids in the model's vocabulary; " + feature,
            }
        ),
        "response_format": _nullable(response_format),
        "structured_outputs": _nullable(structured_outputs),
        "guided_json": _nullable({"type": ["string", "object"], "description": guide}),
        "guided_regex": _nullable({"type": "string", "minLength": 1, "description": guide}),
        "guided_choice": _nullable(
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "description": guide,
            }
        ),
        "guided_grammar": _nullable({"type": "string", "minLength": 1, "description": guide}),
        "top_k": _nullable({**INT64, "minimum": -1, "description": "0 or -1: off"}),
        "ignore_eos": {"type": "boolean", "default": False},
        "return_token_ids": {"type": "boolean", "default": False},
        **_vllm_fields(feature),
        "priority": _nullable(
            {
                "anyOf": [{"enum": ["high", "normal", "low"]}, INT64],
                "description": "a lane, capped by the tenant's tier; vLLM's integer (lower is "
                "earlier): below 0 high, 0 the tenant's default, above 0 low",
            }
        ),
        "deadline": _nullable(
            {
                "type": "number",
                "minimum": DEADLINE_MIN,
                "description": "unix seconds (a time, not a duration): the latest start; one "
                "that has passed, or that the estimated queue wait misses, is 429 "
                "deadline_unmeetable",
            }
        ),
        "cache": _nullable({"type": "boolean"}),
    }
    # stream_options is refused unless stream is true
    stream_rule = {
        "if": {
            "required": ["stream_options"],
            "properties": {"stream_options": {"type": "object"}},
        },
        "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
    }
    # top_logprobs needs logprobs: true; echo cannot come with logprobs (no prompt logprobs)
    top_logprobs_rule = {
        "if": {
            "required": ["top_logprobs"],
            "properties": {"top_logprobs": {"type": "integer"}},
        },
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
    }
    # prompt_logprobs above 0 are not streamed
    prompt_logprobs_rule = {
        "if": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        "then": {"properties": {"prompt_logprobs": {"enum": [None, 0]}}},
    }
    # truncation_side needs truncate_prompt_tokens
    truncation_rule = {
        "if": {
            "required": ["truncation_side"],
            "properties": {"truncation_side": {"type": "string"}},
        },
        "then": {
            "required": ["truncate_prompt_tokens"],
            "properties": {"truncate_prompt_tokens": {"type": "integer"}},
        },
    }
    echo_rule = {
        "if": {
            "required": ["echo", "logprobs", "stream"],
            "properties": {
                "echo": {"const": True},
                "logprobs": {"type": "integer"},
                "stream": {"const": True},
            },
        },
        "then": False,
    }
    token_ids = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0},
        "minItems": 1,
        "description": "token ids, each in the model's vocabulary",
    }

    def prompts(
        most: int, description: str = "a list of several: each prompt its own choices, prompt-major"
    ) -> dict[str, Any]:
        # one text or up to `most`, as strings or token ids: completions' prompts, embeddings'
        # inputs
        return {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {
                    "type": "array",
                    "items": {"type": "string", "minLength": 1},
                    "minItems": 1,
                    "maxItems": most,
                },
                token_ids,
                {"type": "array", "items": token_ids, "minItems": 1, "maxItems": most},
            ],
            "description": description,
        }

    completion: dict[str, Any] = {
        **_object(
            {
                **common,
                "prompt": prompts(settings.max_prompts),
                "echo": {
                    "type": "boolean",
                    "default": False,
                    "description": "the prompt's text before each choice's (with logprobs: its "
                    "logprobs first, not streamed)",
                },
                "logprobs": _nullable(
                    {
                        "type": "integer",
                        "minimum": 0,
                        "maximum": MAX_LOGPROBS,
                        "description": feature,
                    }
                ),
                "best_of": _nullable(
                    {"type": "integer", "minimum": 1, "description": "equal to n when given"}
                ),
                "suffix": _neutral(None, ""),
            },
            ["model", "prompt"],
            closed=True,
        ),
        "allOf": [
            stream_rule,
            echo_rule,
            truncation_rule,
            prompt_logprobs_rule,
            *_without_lacking(served, "completion"),
        ],
    }
    text_part = _tagged("text", {"text": {"type": "string"}}, ["text"])
    tool_call = _object(
        {
            "id": {"type": "string", "minLength": 1},
            "type": {"const": "function"},
            "function": _object(
                {
                    "name": {"type": "string", "minLength": 1},
                    "arguments": {
                        "anyOf": [{"type": "string"}, {"type": "object"}],
                        "description": "a JSON object (as JSON text)",
                    },
                },
                ["name", "arguments"],
            ),
        },
        ["id", "function"],
    )
    message = {
        **_object(
            {
                "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": _nullable(
                    {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
                ),
                "name": _nullable({"type": "string"}),
                "tool_calls": _nullable(
                    {"type": "array", "items": tool_call, "description": "an assistant's calls"}
                ),
                "tool_call_id": _nullable(
                    {"type": "string", "description": "a tool message: the call it answers"}
                ),
                **{
                    name: _nullable({"type": "string", "description": "an assistant's reasoning"})
                    for name in ("reasoning", "reasoning_content")
                },
            },
            ["role"],
            closed=True,
        ),
        "allOf": [
            {  # content may be null (or left out) only in an assistant's message of calls
                "if": {
                    "not": {
                        "required": ["role", "tool_calls"],
                        "properties": {
                            "role": {"const": "assistant"},
                            "tool_calls": {"type": "array", "minItems": 1},
                        },
                    }
                },
                "then": {
                    "required": ["content"],
                    "properties": {"content": {"not": {"type": "null"}}},
                },
            },
            {  # a tool message names the call it answers, and only a tool message does
                "if": {"required": ["role"], "properties": {"role": {"const": "tool"}}},
                "then": {
                    "required": ["tool_call_id"],
                    "properties": {"tool_call_id": {"type": "string", "minLength": 1}},
                },
                "else": {"properties": {"tool_call_id": {"type": "null"}}},
            },
            {  # only an assistant's message carries calls, and reasoning
                "if": {"required": ["role"], "properties": {"role": {"const": "assistant"}}},
                "else": {
                    "properties": {
                        name: {"type": "null"}
                        for name in ("tool_calls", "reasoning", "reasoning_content")
                    }
                },
            },
        ],
    }
    function = {
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
        "description": _nullable({"type": "string"}),
        "parameters": _nullable({"type": "object", "description": "a JSON schema of an object"}),
        "strict": _nullable({"type": "boolean"}),
    }
    tool_choices = {"enum": ["none", "auto", "required"]}
    # continue_final_message needs add_generation_prompt false (its default is true)
    template_rule = {
        "if": {
            "required": ["continue_final_message"],
            "properties": {"continue_final_message": {"const": True}},
        },
        "then": {
            "required": ["add_generation_prompt"],
            "properties": {"add_generation_prompt": {"const": False}},
        },
    }
    chat: dict[str, Any] = {
        **_object(
            {
                **common,
                "messages": {"type": "array", "items": message, "minItems": 1},
                # vLLM's chat template switches
                "add_generation_prompt": {"type": "boolean", "default": True},
                "continue_final_message": {
                    "type": "boolean",
                    "default": False,
                    "description": "the last message left open; not with add_generation_prompt",
                },
                "chat_template": (
                    _nullable({"type": "string", "description": "jinja, as the model's"})
                    if settings.trust_request_chat_template
                    else _neutral(None)
                ),
                "max_completion_tokens": _nullable(max_tokens),
                "logprobs": {"type": "boolean", "default": False, "description": feature},
                "top_logprobs": _nullable(
                    {
                        "type": "integer",
                        "minimum": 0,
                        "maximum": MAX_LOGPROBS,
                        "description": "only with logprobs: true",
                    }
                ),
                "tools": _nullable(
                    {
                        "type": "array",
                        "maxItems": 128,
                        "items": _tagged(
                            "function",
                            {
                                "function": _object(
                                    function,
                                    ["name"],
                                    closed=True,
                                ),
                            },
                            ["function"],
                        ),
                    }
                ),
                "functions": _neutral(None, []),
                "tool_choice": _nullable(
                    {
                        "anyOf": [
                            tool_choices,
                            _tagged(
                                "function",
                                {
                                    "function": _object(
                                        {"name": {"type": "string"}},
                                        ["name"],
                                    ),
                                },
                                ["function"],
                            ),
                        ]
                    }
                ),
                "function_call": _neutral(None, "none"),
                "parallel_tool_calls": _nullable({"type": "boolean"}),
                "store": _nullable({"type": "boolean"}),
                "metadata": _nullable(
                    {"type": "object", "additionalProperties": {"type": "string"}}
                ),
                "service_tier": _nullable({"type": "string"}),
                "reasoning_effort": _nullable(
                    {
                        "enum": ["none", "minimal", "low", "medium", "high", "xhigh", "max"],
                        "description": "a chat template variable (with the `enable_thinking` it "
                        "implies: false for none)",
                    }
                ),
                "chat_template_kwargs": _nullable(
                    {
                        "type": "object",
                        "description": "the chat template's variables (e.g. `enable_thinking`); "
                        "not apply_chat_template's own arguments",
                        "propertyNames": {"not": {"enum": sorted(TEMPLATE_ARGUMENTS)}},
                    }
                ),
                "include_reasoning": {
                    "type": "boolean",
                    "default": True,
                    "description": "false: the reasoning the gateway's reasoning parser splits "
                    "off is left out of the answer",
                },
                "modalities": _neutral(None, ["text"]),
                "audio": _neutral(None),
                "prediction": _neutral(None),
            },
            ["model", "messages"],
            closed=True,
        ),
        "allOf": [
            stream_rule,
            top_logprobs_rule,
            truncation_rule,
            prompt_logprobs_rule,
            template_rule,
            *_without_lacking(served, "chat"),
        ],
    }
    one_job = {"stream": {"const": False}, "n": {"const": 1}}
    job = {
        "description": "a completions or a chat body (chosen by `messages`), without `stream`"
        ", one choice of one prompt (a job per id)",
        "oneOf": [
            {**chat, "properties": {**chat["properties"], **one_job}},
            {
                **completion,
                "properties": {**completion["properties"], **one_job, "prompt": prompts(1)},
                "not": {"required": ["messages"]},
            },
        ],
    }
    batch = _object(
        {
            "input_file_id": {"type": "string"},
            "endpoint": {"enum": list(ENDPOINTS)},
            "completion_window": {"const": "24h"},
            "metadata": _nullable(
                {
                    "type": "object",
                    "maxProperties": 16,
                    "propertyNames": {"maxLength": 64},
                    "additionalProperties": {"type": "string", "maxLength": 512},
                }
            ),
            "output_expires_after": _nullable({"type": "object"}),
        },
        ["input_file_id", "endpoint", "completion_window"],
        closed=True,
    )
    tokenyard = {name: common[name] for name in ("deadline", "cache")}
    tokenyard["priority"] = _nullable({"enum": ["high", "normal", "low"]})
    embedding = _object(
        {
            "model": _embedding_models(models, embedders),
            "input": prompts(MAX_EMBEDDING_INPUTS, "each input within the model's context"),
            "encoding_format": {"enum": ["float", "base64"], "default": "float"},
            "dimensions": _nullable(
                {
                    "type": "integer",
                    "minimum": 1,
                    "description": "a matryoshka model's only (its config says which sizes)",
                }
            ),
            "user": common["user"],
            **_pooling_fields(),
            "normalize": _nullable({"type": "boolean"}),
            "use_activation": _nullable(
                {"type": "boolean", "description": "normalize's newer name: the same value"}
            ),
            **tokenyard,
        },
        ["model", "input"],
        closed=True,
    )
    input_part = _object(
        {"type": {"enum": ["input_text", "output_text"]}, "text": {"type": "string"}},
        ["type", "text"],
    )
    # an earlier response's output item, sent back as input, carries its id and status
    echoed = {"id": {"type": "string"}, "status": {"type": "string"}}
    input_message = _object(
        {
            "type": {"const": "message"},
            "role": {"enum": ["system", "developer", "user", "assistant"]},
            "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": input_part}]},
            **echoed,
        },
        ["role", "content"],
        closed=True,
    )
    call_item = _tagged(
        "function_call",
        {
            "call_id": {"type": "string", "minLength": 1},
            "name": {"type": "string", "minLength": 1},
            "arguments": {"type": "string", "minLength": 1},
            **echoed,
        },
        ["call_id", "name", "arguments"],
        closed=True,
    )
    call_output_item = _tagged(
        "function_call_output",
        {
            "call_id": {"type": "string", "minLength": 1},
            "output": {"anyOf": [{"type": "string"}, {"type": "array", "items": input_part}]},
            **echoed,
        },
        ["call_id", "output"],
        closed=True,
    )
    reasoning_part = _object(
        {
            "type": {"enum": ["reasoning_text", "summary_text"]},
            "text": {"type": "string"},
        },
        ["type", "text"],
    )
    reasoning_item = {
        **_tagged(
            "reasoning",
            {
                "summary": _nullable({"type": "array", "items": reasoning_part}),
                "content": _nullable({"type": "array", "items": reasoning_part}),
                "encrypted_content": _neutral(None),
                **echoed,
            },
            closed=True,
        ),
        "description": "an earlier answer's reasoning: joins the assistant message after it",
    }
    response = {
        **_object(
            {
                "model": common["model"],
                "input": {
                    "anyOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {
                                "anyOf": [
                                    input_message,
                                    call_item,
                                    call_output_item,
                                    reasoning_item,
                                ]
                            },
                            "minItems": 1,
                        },
                    ]
                },
                "instructions": _nullable({"type": "string"}),
                "max_output_tokens": _nullable(max_tokens),
                "temperature": common["temperature"],
                "top_p": common["top_p"],
                "stream": {"type": "boolean", "default": False},
                "background": {"type": "boolean", "default": False},
                "store": {"type": "boolean", "default": True},
                "metadata": chat["properties"]["metadata"],
                "previous_response_id": _nullable(
                    {"type": "string", "minLength": 1, "description": "a stored response's id"}
                ),
                "user": common["user"],
                "safety_identifier": _nullable({"type": "string"}),
                "tools": _nullable(
                    {
                        "type": "array",
                        "maxItems": 128,
                        "items": _tagged(
                            "function",
                            function,
                            ["name"],
                            closed=True,
                        ),
                    }
                ),
                "tool_choice": _nullable(
                    {
                        "anyOf": [
                            tool_choices,
                            _tagged(
                                "function",
                                {
                                    "name": {"type": "string"},
                                },
                                ["name"],
                            ),
                        ]
                    }
                ),
                "parallel_tool_calls": _nullable({"type": "boolean"}),
                "text": _nullable(
                    _object(
                        {"format": _nullable(text_format)},
                        closed=True,
                    )
                ),
                "truncation": _neutral(None, "disabled"),
                "include": _neutral(None, []),
                "reasoning": _nullable(
                    {
                        **_object(
                            {
                                "effort": chat["properties"]["reasoning_effort"],
                                "summary": _neutral(None),
                                "generate_summary": _neutral(None),
                            },
                            closed=True,
                        ),
                        "description": "effort: a chat template variable (chat's reasoning_effort)",
                    }
                ),
                "service_tier": _neutral(None, "auto", "default"),
                "top_logprobs": _neutral(None, 0),
                "stream_options": _nullable(
                    {
                        **_object(
                            {"include_obfuscation": {"type": "boolean"}},
                            closed=True,
                        ),
                        "description": "only with stream: true",
                    }
                ),
            },
            ["model", "input"],
            closed=True,
        ),
        "allOf": [
            stream_rule,
            {  # a background response is read later: it must be stored
                "if": {"required": ["background"], "properties": {"background": {"const": True}}},
                "then": {"properties": {"store": {"const": True}}},
            },
        ],
    }
    return {
        "CompletionRequest": completion,
        "ChatCompletionRequest": chat,
        "JobRequest": job,
        "CreateBatchRequest": batch,
        "EmbeddingRequest": embedding,
        **_vllm_requests(common, chat, token_ids, template_rule),
        **_scoring_requests(models, scorers, tokenyard, common["user"]),
        "ResponseRequest": response,
        "MessageRequest": {
            **_message_request(common, max_tokens),
            # schemathesis' examples phase sends it: one request the server accepts for sure
            "example": {
                "model": common["model"]["enum"][0],
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "Hello"}],
            },
        },
    }


def _vllm_requests(
    common: dict[str, Any],
    chat: dict[str, Any],
    token_ids: dict[str, Any],
    template_rule: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """vLLM's own routes' bodies (`gateway/vllm_api.py`): /tokenize (a prompt, or messages
    through the chat template, as a chat completion renders them) and /detokenize."""
    model = _nullable(common["model"])
    strs = _nullable({"type": "boolean"})
    prompt_tokenize = _object(
        {
            "model": model,
            "prompt": {"type": "string"},
            "add_special_tokens": {"type": "boolean", "default": True},
            "return_token_strs": strs,
        },
        ["prompt"],
        closed=True,
    )
    chat_tokenize = {
        **_object(
            {
                "model": model,
                "messages": chat["properties"]["messages"],
                "tools": chat["properties"]["tools"],
                "add_special_tokens": {"type": "boolean", "default": False},
                "return_token_strs": strs,
                # the chat completion's template switches, variables and (trusted) template
                **{
                    name: chat["properties"][name]
                    for name in (
                        "add_generation_prompt",
                        "continue_final_message",
                        "chat_template",
                        "chat_template_kwargs",
                    )
                },
                "mm_processor_kwargs": _neutral(None),
                "media_io_kwargs": _neutral(None),
            },
            ["messages"],
            closed=True,
        ),
        "allOf": [template_rule],
    }
    return {
        "TokenizeRequest": {"anyOf": [prompt_tokenize, chat_tokenize]},
        "DetokenizeRequest": _object(
            {"model": model, "tokens": {**token_ids, "minItems": 0}},
            ["tokens"],
            closed=True,
        ),
    }


def _pooling_fields() -> dict[str, Any]:
    """vLLM's truncation of each input (embeddings, score, rerank)."""
    return {
        "truncate_prompt_tokens": _nullable(
            {
                "type": "integer",
                "minimum": -1,
                "not": {"const": 0},
                "description": "keep this many tokens of each input (-1: the model's "
                "context), at most the model's context",
            }
        ),
        "truncation_side": _nullable({"enum": ["left", "right"]}),
    }


def _scoring_requests(
    models: Sequence[str],
    scorers: Collection[str] | None,
    tokenyard: dict[str, Any],
    user: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """vLLM's score and rerank bodies (`gateway/vllm_api.py`): a model that does not score is
    400; with none, the operations are left out of the document (`document`)."""
    names = list(models) if scorers is None else [m for m in models if m in scorers]
    texts = {
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1},
        ]
    }
    activation = _nullable({"type": "boolean"})
    common = {
        "model": _nullable({"enum": names or list(models)}),
        "user": user,
        **_pooling_fields(),
        "use_activation": activation,
        "softmax": activation,
        "activation": activation,
        "padding": _nullable({"const": "do_not_pad"}),
        "mm_processor_kwargs": _neutral(None),
        "request_id": _nullable({"type": "string"}),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": 1024}),
        **tokenyard,
        "priority": _nullable({"enum": ["high", "normal", "low", 0]}),
    }
    one_pair = "one pair of fields: text_1/text_2, data_1/data_2, or queries/documents (items)"

    def pair(first: str, second: str) -> dict[str, Any]:
        return {
            **_object(
                {**common, first: texts, second: texts},
                [first, second],
                closed=True,
            ),
            "description": one_pair + "; a list of firsts as long as the seconds, or one",
        }

    return {
        "ScoreRequest": {
            "oneOf": [
                pair("text_1", "text_2"),
                pair("data_1", "data_2"),
                pair("queries", "documents"),
                pair("queries", "items"),
            ]
        },
        "RerankRequest": _object(
            {
                **common,
                "query": {"type": "string"},
                "documents": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "top_n": {"type": "integer", "description": "0 or less: all"},
                "return_documents": {"type": "boolean", "default": True},
            },
            ["query", "documents"],
            closed=True,
        ),
    }


def _embedding_models(models: Sequence[str], embedders: Collection[str] | None) -> dict[str, Any]:
    """The names an embeddings request may give: a model whose workers only generate is 400
    (`model_not_supported`), as vLLM answers one that does not embed; with none, the operation
    is left out of the document (`document`)."""
    names = list(models) if embedders is None else [m for m in models if m in embedders]
    return {"enum": names or list(models)}


def _message_request(common: dict[str, Any], max_tokens: dict[str, Any]) -> dict[str, Any]:
    """Anthropic's Messages API body, as `gateway/anthropic.py` takes it."""
    cache_control = _nullable({"type": "object"})

    def block(kind: str, required: list[str], **properties: Any) -> dict[str, Any]:
        return _tagged(
            kind,
            {**properties, "cache_control": cache_control},
            required,
            closed=True,
        )

    text = block("text", ["text"], text={"type": "string"}, citations={"type": "null"})
    texts = {"anyOf": [{"type": "string"}, {"type": "array", "items": text}]}
    tool_use = block(
        "tool_use",
        ["id", "name", "input"],
        id={"type": "string", "minLength": 1},
        name={"type": "string", "minLength": 1},
        input={"type": "object"},
    )
    tool_result = block(
        "tool_result",
        ["tool_use_id"],
        tool_use_id={"type": "string", "minLength": 1},
        content=_nullable(texts),
        is_error={"type": "boolean"},
    )

    def message(role: str, *blocks: dict[str, Any]) -> dict[str, Any]:
        content = {"type": "array", "items": {"anyOf": list(blocks)}}
        return _object(
            {
                "role": {"const": role},
                "content": {"anyOf": [{"type": "string"}, content]},
            },
            ["role", "content"],
            closed=True,
        )

    tool = _object(
        {
            "name": {"type": "string", "pattern": TOOL_NAME},
            "description": _nullable({"type": "string"}),
            "input_schema": {"type": "object"},
            "type": _nullable({"const": "custom"}),
            "cache_control": cache_control,
        },
        ["name", "input_schema"],
        closed=True,
    )
    parallel = _nullable({"type": "boolean"})
    choices = [
        _tagged(
            kind,
            {"disable_parallel_tool_use": parallel},
            closed=True,
        )
        for kind in ("auto", "any", "none")
    ]
    named = _tagged(
        "tool",
        {
            "name": {"type": "string", "minLength": 1},
            "disable_parallel_tool_use": parallel,
        },
        ["name"],
        closed=True,
    )
    thinking = _tagged(
        "thinking",
        {
            "thinking": {"type": "string"},
            "signature": _nullable({"type": "string"}),
        },
        ["thinking"],
        closed=True,
    )
    turns = [message("user", text, tool_result), message("assistant", text, tool_use, thinking)]
    return {
        **_object(
            {
                "model": common["model"],
                "max_tokens": max_tokens,
                "messages": {"type": "array", "items": {"anyOf": turns}, "minItems": 1},
                "system": _nullable(texts),
                "stop_sequences": _nullable(
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1},
                        "maxItems": STOP_SEQUENCES_MAX,
                    }
                ),
                "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
                "top_p": common["top_p"],
                "top_k": common["top_k"],
                "stream": {"type": "boolean", "default": False},
                "metadata": _nullable(
                    _object(
                        {"user_id": _nullable({"type": "string"})},
                        closed=True,
                    )
                ),
                "tools": _nullable({"type": "array", "items": tool, "maxItems": MAX_TOOLS}),
                "tool_choice": _nullable({"anyOf": [*choices, named]}),
                "thinking": _nullable(
                    {
                        **_object(
                            {
                                "type": {"enum": ["enabled", "disabled"]},
                                "budget_tokens": _nullable({"type": "integer", "minimum": 1}),
                            },
                            ["type"],
                            closed=True,
                        ),
                        "description": "enabled: the reasoning a reasoning parser splits off is "
                        "answered as thinking blocks (budget_tokens is not enforced); disabled: "
                        "the chat template's thinking is off (reasoning_effort none)",
                    }
                ),
                "cache_control": cache_control,
                **{name: common[name] for name in ("priority", "deadline", "cache")},
            },
            ["model", "max_tokens", "messages"],
            closed=True,
        ),
        # tool_choice any or tool picks from the tools offered: there must be some
        "if": {
            "required": ["tool_choice"],
            "properties": {
                "tool_choice": _object(
                    {"type": {"enum": ["any", "tool"]}},
                    ["type"],
                )
            },
        },
        "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
    }


# what every operation may answer besides its own: a parameter's value, and the key lookup
_SHARED = (400, 401, 503)
_PUBLIC = ("/health", "/healthz", "/readyz")  # no key, ever (probes)


def document(
    app: FastAPI, settings: GatewaySettings, models: Sequence[str], served: Served | None = None
) -> dict[str, Any]:
    """The OpenAPI document of `app`: FastAPI's, with the bodies and statuses routes declare,
    the shared statuses on every operation, and FastAPI's unused 422 gone; without `/v1/
    embeddings` while no model served here embeds, nor `/v1/score` and `/v1/rerank` while none
    scores (every request to them is refused)."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas["Error"] = ERROR
    schemas.update(request_schemas(settings, models, served))
    if served is not None and not served.embedders:
        doc["paths"].pop("/v1/embeddings", None)
        schemas.pop("EmbeddingRequest", None)
    if served is not None and served.scorers is not None and not served.scorers:
        for path, schema in (("/v1/score", "ScoreRequest"), ("/v1/rerank", "RerankRequest")):
            doc["paths"].pop(path, None)
            schemas.pop(schema, None)

    for path, operations in doc["paths"].items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            responses.pop("422", None)
            shared = [] if path in _PUBLIC else list(_SHARED)
            if "requestBody" in operation:
                shared.append(413)
            for status in shared:
                responses.setdefault(str(status), answers(status)[status])
            if anthropic_path(path):
                _anthropic_errors(responses)
    schemas["AnthropicError"] = ANTHROPIC_ERROR
    return doc


def _anthropic_errors(responses: dict[str, Any]) -> None:
    """An operation of Anthropic's API: its errors in Anthropic's shape, and its 529 where the
    other APIs answer 503 (`errors.anthropic_error` decides both)."""
    if "503" in responses:
        del responses["503"]
        responses["529"] = answers(529)[529]
    content = {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}
    for status, response in list(responses.items()):
        if status.isdigit() and int(status) >= 400:
            responses[status] = {**response, "content": content}


async def _docs_reader(request: Request) -> None:
    """Who may read the API's description: anyone with `docs_public`, else a caller with a key
    (when keys are configured), as for the API it describes."""
    if not request.app.state.gateway.settings.docs_public:
        await authenticate(request)


DocsDep = Annotated[None, Depends(_docs_reader)]
router = APIRouter(include_in_schema=False)


async def _served(request: Request) -> Served:
    """What the models behind the names can do, by what their workers publish (until one
    does, everything is admitted: `PublishedLimits.of`)."""
    state = gateway(request)
    names: Mapping[str, str] = request.app.state.openapi_served
    limits = {}
    for model in set(names.values()):
        tokenizer = state.tokenizers.get(model)
        if tokenizer is not None:
            limits[model] = await state.limits.of(model, tokenizer)
    return Served(
        embedders=frozenset(n for n, m in names.items() if m not in limits or limits[m].embeds),
        scorers=frozenset(n for n, m in names.items() if m not in limits or limits[m].scores),
        lacking=frozenset(
            (feature, name)
            for name, model in names.items()
            if model in limits
            for feature in Feature
            if feature not in limits[model].features
        ),
    )


@router.get("/openapi.json")
async def openapi_json(request: Request, _: DocsDep) -> JSONResponse:
    return JSONResponse(request.app.state.openapi_for(await _served(request)))


@router.get("/docs")
async def swagger(request: Request, _: DocsDep) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - docs")


@router.get("/redoc")
async def redoc(request: Request, _: DocsDep) -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title=f"{request.app.title} - ReDoc")


def install(app: FastAPI, settings: GatewaySettings, served: Mapping[str, str]) -> None:
    """Serve the document and its pages behind `_docs_reader`; `served`: each name a request
    may give (models and aliases) with its model. The document is built on first read, and again
    when what the models can do changes (their workers say it)."""
    models = list(served)
    cached: dict[Served | None, dict[str, Any]] = {}

    def openapi_for(served: Served | None = None) -> dict[str, Any]:
        if served not in cached:
            cached.clear()
            cached[served] = document(app, settings, models, served)
        return cached[served]

    app.openapi = openapi_for  # type: ignore[method-assign]
    app.state.openapi_for = openapi_for
    app.state.openapi_served = served
    app.include_router(router)
