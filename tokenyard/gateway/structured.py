"""Structured outputs: a request's constraint on what may be generated, as one `Guide`.

Requests name it as OpenAI does (`response_format`: `json_object`, `json_schema`) or as vLLM
does (`structured_outputs`: `json`, `regex`, `choice`, `grammar`, `json_object`; and the older
top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`). At most one
constraint per request. The gateway checks that xgrammar (the engines' compiler) can convert it
before the job is queued, so a bad schema is the client's 400 rather than a failed job; the
check runs in a thread with a time bound, so a pathological schema cannot hold the gateway.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from tokenyard.errors import InvalidRequest
from tokenyard.gateway.errors import ApiError, unsupported
from tokenyard.messages import Guide

if TYPE_CHECKING:
    from tokenyard.gateway.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)

# xgrammar converts an ordinary schema in milliseconds; past this the request is refused
CHECK_TIMEOUT_S = 5.0
# conversions running at once, abandoned ones included: a thread cannot be stopped, so those
# that outlive their bound must not add up without limit
MAX_RUNNING = 4
_RUNNING = threading.BoundedSemaphore(MAX_RUNNING)
_VLLM_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def guide_of(body: CompletionRequest | ChatCompletionRequest) -> tuple[Guide, str] | None:
    """The request's one constraint and the parameter that named it; None: unconstrained. Two
    constraints, or a malformed one, are 400 naming the parameter."""
    found: list[tuple[Guide, str]] = []
    if body.response_format is not None:
        guide = _response_format(body.response_format)
        if guide is not None:
            found.append((guide, "response_format"))
    if body.structured_outputs is not None:
        found.extend(_structured_outputs(body.structured_outputs))
    for name, field in _GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append((_vllm_guide(field, value, name), name))
    if len(found) > 1:
        names = ", ".join(f"'{param}'" for _, param in found)
        raise InvalidRequest(
            f"Only one structured output constraint is allowed per request; got {names}",
            param=found[1][1],
        )
    return found[0] if found else None


def _response_format(value: dict[str, Any]) -> Guide | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        param = "response_format.json_schema"
        if not isinstance(spec, dict):
            raise InvalidRequest(
                "'response_format.json_schema' must be an object with 'name' and 'schema'",
                param=param,
            )
        name = spec.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise InvalidRequest(
                "'response_format.json_schema.name' must be 1 to 64 letters, digits, _ or -",
                param=f"{param}.name",
            )
        if not isinstance(spec.get("strict", False), bool | None):
            raise InvalidRequest(
                "'response_format.json_schema.strict' must be a boolean", param=f"{param}.strict"
            )
        # OpenAI makes the schema optional (any JSON object then)
        schema = spec.get("schema", {"type": "object"})
        return Guide(json=_schema_text(schema, f"{param}.schema", text=False))
    if kind == "structural_tag":
        raise unsupported("response_format", "of type 'structural_tag'")
    raise InvalidRequest(
        "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
        param="response_format.type",
    )


def _structured_outputs(value: dict[str, Any]) -> list[tuple[Guide, str]]:
    for key in sorted(value):
        other = value[key]
        if key not in _VLLM_FIELDS and not (other is None or other is False or other == ""):
            # vLLM's whitespace and backend switches, structural tags: not carried to engines
            raise unsupported(f"structured_outputs.{key}")
    found = []
    for key in _VLLM_FIELDS:
        given = value.get(key)
        if given is None or (key == "json_object" and given is False):
            continue
        param = f"structured_outputs.{key}"
        found.append((_vllm_guide(key, given, param), param))
    return found


def _vllm_guide(field: str, value: Any, param: str) -> Guide:
    if field == "json":
        return Guide(json=_schema_text(value, param))
    if field == "json_object":
        if value is not True:  # False is no constraint (see _structured_outputs)
            raise InvalidRequest(f"'{param}' must be a boolean", param=param)
        return Guide(json_object=True)
    if field == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise InvalidRequest(
                f"'{param}' must be a non-empty list of non-empty strings", param=param
            )
        return Guide(choice=tuple(value))
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"'{param}' must be a non-empty string", param=param)
    return Guide(regex=value) if field == "regex" else Guide(grammar=value)


def _schema_text(schema: Any, param: str, *, text: bool = True) -> str:
    """A schema as compact JSON text, its keys in the request's order: a schema's property order
    is the order the model writes them in (as vLLM and OpenAI do), so it is part of the
    answer's cache key; `text`: it may come as JSON text, as vLLM's fields take it (OpenAI's is
    an object)."""
    if isinstance(schema, str) and text:
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"'{param}' is not valid JSON: {exc}", param=param) from exc
    if not isinstance(schema, dict) and not (schema is True or schema is False):
        raise InvalidRequest(f"'{param}' must be a JSON Schema (an object)", param=param)
    return json.dumps(schema, separators=(",", ":"))


async def check(guide: Guide, param: str) -> None:
    """400 naming `param` unless xgrammar converts the constraint within `CHECK_TIMEOUT_S`.

    Verdicts are remembered by the constraint's digest (applications send the same schema with
    every request); a timeout only for `TIMEOUT_KEPT_S`, so a schema that was slow on a busy
    moment is tried again, while one sent again and again does not take a thread each time.
    A conversion cannot be stopped, only abandoned: at most `MAX_RUNNING` run at once (an
    abandoned one keeps its place until it ends), and a check that finds no place within the
    time bound is 503, to retry."""
    key = hashlib.blake2b(msgspec.msgpack.encode(guide), digest_size=16).digest()
    if key in _verdicts:
        _verdicts.move_to_end(key)
        problem = _verdicts[key]
    elif _timeouts.get(key, 0.0) > time.monotonic():
        problem = _TIMED_OUT
    else:
        problem = await _convert(guide)
        if problem == _TIMED_OUT:
            _timeouts[key] = time.monotonic() + TIMEOUT_KEPT_S
            if len(_timeouts) > _VERDICTS_KEPT:
                _timeouts.pop(next(iter(_timeouts)))
        else:
            _verdicts[key] = problem
            if len(_verdicts) > _VERDICTS_KEPT:
                _verdicts.popitem(last=False)
    if problem == _TIMED_OUT:
        raise InvalidRequest(
            f"'{param}' could not be compiled within {CHECK_TIMEOUT_S:g}s; simplify it",
            param=param,
            code="invalid_value",
        )
    if problem is not None:
        raise InvalidRequest(f"Invalid '{param}': {problem}", param=param, code="invalid_value")


async def _convert(guide: Guide) -> str | None:
    """`_problem` in a thread holding one of the `MAX_RUNNING` places, within the time bound
    (counted from when it holds one); `_TIMED_OUT` past it."""
    give_up = time.monotonic() + CHECK_TIMEOUT_S
    while not _RUNNING.acquire(blocking=False):
        if time.monotonic() > give_up:
            raise ApiError(
                503,
                "too many structured output checks are running; retry shortly",
                code="structured_output_busy",
                headers={"Retry-After": "1"},
            )
        await anyio.sleep(0.01)
    problem: str | None = _TIMED_OUT
    with anyio.move_on_after(CHECK_TIMEOUT_S):
        problem = await anyio.to_thread.run_sync(_held, guide, abandon_on_cancel=True)
    return problem


def _held(guide: Guide) -> str | None:
    try:
        return _problem(guide)
    finally:
        _RUNNING.release()  # here, not in the caller: an abandoned conversion keeps its place


# digest of a constraint -> why xgrammar refused it (None: it did not); the event loop's alone
_verdicts: OrderedDict[bytes, str | None] = OrderedDict()
_VERDICTS_KEPT = 4096
# digest of a constraint whose conversion timed out -> until when that is the answer
_timeouts: dict[bytes, float] = {}
TIMEOUT_KEPT_S = 60.0
_TIMED_OUT = "\0timed out"  # no message of xgrammar's starts with a NUL
# xgrammar's messages start with a timestamp and its C++ source position
_XGRAMMAR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")


def _problem(guide: Guide) -> str | None:
    """Why xgrammar cannot convert the constraint, or None."""
    try:
        import xgrammar
    except ImportError:  # a gateway without the hf extra: the engine compiles and refuses
        log.warning("xgrammar is not installed: structured outputs are checked by the engines")
        return None
    kind, value = guide.field
    try:
        if kind == "json":
            xgrammar.Grammar.from_json_schema(value)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(value)
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(value)
    except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) for bad input
        text = _XGRAMMAR_PREFIX.sub("", str(exc)).strip()
        return text.splitlines()[0][:500] if text else type(exc).__name__
    return None
