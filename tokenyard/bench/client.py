"""One streamed request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import httpx

from tokenyard.bench.stats import intervals
from tokenyard.bench.workload import RequestSpec

DETAIL_LIMIT = 300


class Endpoint(StrEnum):
    """Which OpenAI API a request goes to."""

    completions = "completions"
    chat = "chat"

    @property
    def path(self) -> str:
        # relative, so it lands under the base URL's own path (e.g. /v1)
        return "completions" if self is Endpoint.completions else "chat/completions"


@dataclass(frozen=True)
class RequestOptions:
    """How requests are shaped, beyond what the workload chooses."""

    endpoint: Endpoint
    model: str
    include_usage: bool = True
    ignore_eos: bool = False
    min_tokens: bool = False
    temperature: float | None = None
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    # several served names (a base's LoRA adapters): request i asks for models[i % len], so
    # every server measured gets the same mix in the same order; empty: `model` for all
    models: tuple[str, ...] = ()

    def model_for(self, index: int) -> str:
        return self.models[index % len(self.models)] if self.models else self.model


def build_body(spec: RequestSpec, options: RequestOptions) -> dict[str, Any]:
    """The JSON body of one streamed request; non-standard fields only when asked for."""
    body: dict[str, Any] = {
        "model": options.model_for(spec.index),
        "max_tokens": spec.max_tokens,
        "stream": True,
    }
    if options.endpoint is Endpoint.chat:
        body["messages"] = spec.chat_messages()
    else:
        body["prompt"] = spec.prompt
    if options.include_usage:
        body["stream_options"] = {"include_usage": True}
    if options.temperature is not None:
        body["temperature"] = options.temperature
    if options.ignore_eos:
        body["ignore_eos"] = True
    if options.min_tokens:
        body["min_tokens"] = spec.max_tokens
    body.update(options.extra_body)
    return body


@dataclass
class RequestResult:
    """Timings (`time.perf_counter` seconds) and outcome of one request."""

    index: int
    send_s: float
    end_s: float = 0.0
    first_token_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    # events that carried token ids (asked with `return_token_ids`), text or not: one per
    # engine step on a server that streams every step
    token_events: int = 0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    usage_reported: bool = False
    finish_reason: str | None = None
    status: int | None = None
    # HTTP status ("429"), exception class ("ConnectError"), "stream_error" or "incomplete_stream"
    error: str | None = None
    error_detail: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.send_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.send_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between content chunks (a chunk may carry several tokens on coalescing servers)."""
        return intervals(self.chunk_times)

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, from the token count (usage if given)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def fail(self, kind: str, detail: str | None = None) -> None:
        self.error = kind
        self.error_detail = None if detail is None else detail[:DETAIL_LIMIT]


class SSEDecoder:
    """Line-by-line Server-Sent Events decoder; `feed` returns an event's data once complete."""

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        """Take one line (without its newline); a blank line dispatches the pending event."""
        if not line:
            return self.flush()
        if line.startswith(":"):
            return None  # a comment, e.g. a keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None

    def flush(self) -> str | None:
        """The pending event's data, if any (also for a stream that ends without a blank line)."""
        if not self._data:
            return None
        data, self._data = "\n".join(self._data), []
        return data


def chunk_token_ids(chunk: Mapping[str, Any]) -> int:
    """Token ids a chunk carries (vLLM's and tokenyard's `return_token_ids`)."""
    count = 0
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids") if isinstance(choice, dict) else None
        count += len(ids) if isinstance(ids, list) else 0
    return count


def chunk_text(chunk: Mapping[str, Any]) -> str:
    """Generated text of a completion or chat chunk (reasoning text counts as output too)."""
    parts: list[str] = []
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        if isinstance(text, str):
            parts.append(text)
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in ("content", "reasoning_content", "reasoning"):
                value = delta.get(key)
                if isinstance(value, str):
                    parts.append(value)
    return "".join(parts)


def chunk_finish_reason(chunk: Mapping[str, Any]) -> str | None:
    for choice in chunk.get("choices") or ():
        if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
            return str(choice["finish_reason"])
    return None


def error_message(body: bytes | str) -> str:
    """The `error.message` of an OpenAI error body, else the body itself."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    if isinstance(parsed, dict):
        error = parsed.get("error", parsed)
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(error, str):
            return error
    return text


TokenCallback = Callable[[int], None]


async def send_request(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    options: RequestOptions,
    on_chunk: TokenCallback | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestResult:
    """Send one streamed request and time it; never raises for HTTP or transport errors."""
    body = build_body(spec, options)
    result = RequestResult(index=spec.index, send_s=clock())
    try:
        async with client.stream("POST", options.endpoint.path, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.fail(str(response.status_code), error_message(await response.aread()))
            else:
                await _read_stream(response, result, on_chunk, clock)
    except Exception as exc:  # every failure is a data point, counted by its class
        result.fail(type(exc).__name__, str(exc) or repr(exc))
    finally:
        result.end_s = clock()
    return result


_EOL = re.compile(r"\r\n|\r|\n")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Lines split only at CR, LF or CRLF, as SSE defines them.

    httpx's aiter_lines also splits at U+0085, U+2028 and U+2029, which JSON leaves unescaped
    inside strings, so a token containing one would break its chunk apart.
    """
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        # a CR at the very end may be the first half of a CRLF: keep it for the next piece
        cut = len(buffer) - 1 if buffer.endswith("\r") else len(buffer)
        lines = _EOL.split(buffer[:cut])
        buffer = lines.pop() + buffer[cut:]
        for line in lines:
            yield line
    if buffer:
        for line in _EOL.split(buffer):
            if line:
                yield line


async def _read_stream(
    response: httpx.Response,
    result: RequestResult,
    on_chunk: TokenCallback | None,
    clock: Callable[[], float],
) -> None:
    reader = _ChunkReader(result, on_chunk, clock)
    decoder = SSEDecoder()
    async for line in sse_lines(response):
        data = decoder.feed(line)
        if data is not None and reader.event(data):
            break
    else:
        # the server closed without a blank line after its last event
        data = decoder.flush()
        if data is not None:
            reader.event(data)
    reader.close()


class _ChunkReader:
    """Applies decoded SSE events to a result; `event` returns True when the stream is over."""

    def __init__(
        self, result: RequestResult, on_chunk: TokenCallback | None, clock: Callable[[], float]
    ) -> None:
        self.result, self.on_chunk, self.clock = result, on_chunk, clock
        self.done = False
        self.content_chunks = 0

    def event(self, data: str) -> bool:
        result = self.result
        if data.strip() == "[DONE]":
            self.done = True
            return True
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            return False
        if "error" in chunk:
            result.fail("stream_error", error_message(data))
            return True
        if chunk_token_ids(chunk):
            result.token_events += 1
        if chunk_text(chunk):
            now = self.clock()
            if result.first_token_s is None:
                result.first_token_s = now
            result.chunk_times.append(now)
            self.content_chunks += 1
            if self.on_chunk is not None:
                self.on_chunk(1)
        result.finish_reason = chunk_finish_reason(chunk) or result.finish_reason
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            # some servers repeat usage on every chunk; the last one is the total
            result.usage_reported = True
            result.output_tokens = usage["completion_tokens"]
            prompt = usage.get("prompt_tokens")
            result.prompt_tokens = prompt if isinstance(prompt, int) else None
        return False

    def close(self) -> None:
        result = self.result
        if not result.usage_reported:
            result.output_tokens = self.content_chunks
        if not self.done and result.ok:
            result.fail("incomplete_stream", "the stream ended without data: [DONE]")
