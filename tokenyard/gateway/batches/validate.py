"""Parse and check a batch input file up front: every line, or the batch fails."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from tokenyard.errors import UserError
from tokenyard.gateway import protocol, structured
from tokenyard.gateway.batches.types import ENDPOINTS
from tokenyard.gateway.jsonbody import check_json
from tokenyard.messages import LineError

Kind = Literal["completion", "chat", "embedding"]
KIND_OF_URL: dict[str, Kind] = {
    "/v1/completions": "completion",
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embedding",
}
REQUEST_OF: dict[Kind, type[protocol.Request]] = {
    "completion": protocol.CompletionRequest,
    "chat": protocol.ChatCompletionRequest,
    "embedding": protocol.EmbeddingRequest,
}


class BatchLine(msgspec.Struct, kw_only=True):
    """One request of a batch, validated; `body` is the request body's JSON."""

    custom_id: str
    url: str
    body: bytes

    @property
    def kind(self) -> Kind:
        return KIND_OF_URL[self.url]


def _line_error(code: str, message: str, line: int, param: str | None = None) -> LineError:
    return LineError(code=code, message=message, param=param, line=line)


def parse_lines(
    data: bytes, endpoint: str, max_requests: int
) -> tuple[list[BatchLine], list[LineError]]:
    """The file's requests, or the errors that fail the batch (each with its 1-based line)."""
    lines: list[BatchLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    raw_lines = [r for r in data.split(b"\n")]
    count = 0
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        count += 1
        if count > max_requests:
            errors.append(
                _line_error(
                    "too_many_requests",
                    f"The batch has more than {max_requests} requests",
                    number,
                )
            )
            break
        error = _check_line(raw, number, endpoint, seen)
        if isinstance(error, LineError):
            errors.append(error)
        else:
            lines.append(error)
    if not lines and not errors:
        errors.append(LineError(code="empty_file", message="The input file has no requests"))
    return lines, errors


def _check_line(raw: bytes, number: int, endpoint: str, seen: set[str]) -> BatchLine | LineError:
    try:
        check_json(raw)
    except UserError as exc:
        return _line_error(exc.code or "invalid_json_line", exc.message, number)
    try:
        obj: Any = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return _line_error("invalid_json_line", f"This line is not valid JSON: {exc}", number)
    if not isinstance(obj, dict):
        return _line_error("invalid_json_line", "Each line must be a JSON object", number)
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _line_error(
            "missing_required_parameter", "'custom_id' is required (a string)", number, "custom_id"
        )
    if custom_id in seen:
        return _line_error(
            "duplicate_custom_id",
            f"The custom_id '{custom_id}' appears more than once in this file",
            number,
            "custom_id",
        )
    seen.add(custom_id)
    method = obj.get("method")
    if method != "POST":
        return _line_error("invalid_method", "'method' must be 'POST'", number, "method")
    url = obj.get("url")
    if url not in ENDPOINTS:
        return _line_error(
            "invalid_url", f"'url' must be one of {', '.join(ENDPOINTS)}", number, "url"
        )
    if url != endpoint:
        return _line_error(
            "mismatched_endpoint",
            f"The url '{url}' does not match the batch's endpoint '{endpoint}'",
            number,
            "url",
        )
    body = obj.get("body")
    if not isinstance(body, dict):
        return _line_error("invalid_body", "'body' must be a JSON object", number, "body")
    encoded = msgspec.json.encode(body)
    try:
        parsed = protocol.parse(REQUEST_OF[KIND_OF_URL[url]], encoded)
        parsed.refuse_unsupported()
        if getattr(parsed, "stream", False):
            raise UserError("'stream' is not allowed in a batch", param="stream")
        if isinstance(parsed, protocol.CompletionRequest | protocol.ChatCompletionRequest):
            parsed.refuse_choices("in a batch (one job per line)")
            if isinstance(parsed, protocol.CompletionRequest):
                parsed.refuse_prompts("in a batch (one job per line)")
            # the constraint's shape now; whether xgrammar compiles it, when the line is run
            structured.guide_of(parsed)
    except UserError as exc:
        return _line_error(exc.code or "invalid_body", exc.message, number, exc.param or "body")
    return BatchLine(custom_id=custom_id, url=url, body=encoded)
