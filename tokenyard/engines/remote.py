"""Remote engine: forwards each sequence to an OpenAI-compatible server as a streamed completion.

The upstream (a `vllm serve`, another tokenyard gateway, any server that streams generated
token ids with `return_token_ids`) does the batching; this engine only holds up to
`concurrency` streams open. Prompts go up as token ids and text is decoded here from the
token ids that come back, so stop strings, resume and usage are exact whatever the upstream's
detokenizer does, and a redelivered job continues from prompt + streamed tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from tokenyard.engines.base import EngineCapacity, default_seed
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path
from tokenyard.engines.streams import StreamEngine, StreamSeq
from tokenyard.errors import UpstreamError
from tokenyard.messages import FinishReason

log = logging.getLogger(__name__)


class RemoteEngine(StreamEngine):
    """Streams each sequence from an OpenAI-compatible `/v1/completions`; capacity = concurrency."""

    name = "remote"

    def __init__(
        self,
        *,
        model: str,
        url: str,
        upstream_model: str | None = None,
        concurrency: int = 64,
        api_key: str | None = None,
        max_model_len: int | None = None,
        retries: int = 5,
        backoff_s: float = 0.5,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__()
        tok = load_hf_tokenizer(resolve_model_path(model))
        if max_model_len is not None:
            tok = HFTokenizer(tok.hf, max_model_len, sorted(tok.eos_token_ids))
        self.tokenizer: HFTokenizer = tok
        length = tok.max_model_len
        self.capacity = EngineCapacity(max_seqs=concurrency, max_tokens=concurrency * length)
        self.url = url.rstrip("/")
        self.upstream_model = upstream_model or model
        self.api_key = api_key
        self.retries = retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._client: httpx.AsyncClient | None = None
        self._slots = asyncio.Semaphore(concurrency)

    async def open(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(self.timeout_s, connect=10.0),
            limits=httpx.Limits(
                max_connections=self.capacity.max_seqs, max_keepalive_connections=None
            ),
        )

    async def close_runtime(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    async def generate(self, seq: StreamSeq) -> None:
        async with self._slots:
            try:
                await self._stream_with_retries(seq)
            except UpstreamError as exc:
                self.fail(seq, str(exc), refused=exc.refused)

    async def _stream_with_retries(self, seq: StreamSeq) -> None:
        attempt = 0
        while True:
            before = len(seq.generated)
            try:
                await self._stream(seq)
                return
            except (httpx.TransportError, UpstreamError) as exc:
                retry = not isinstance(exc, UpstreamError) or exc.retry
                if len(seq.generated) > before:
                    attempt = 0  # progress was made: the next failure starts a fresh count
                if not retry or attempt >= self.retries:
                    if isinstance(exc, UpstreamError):
                        raise
                    raise UpstreamError(
                        f"upstream {self.url} unreachable: {exc!r}", retry=False
                    ) from exc
                delay = min(self.backoff_s * 2**attempt, 30.0)
                attempt += 1
                log.warning(
                    "upstream error for %s (%s); retry %d in %.1fs", seq.seq_id, exc, attempt, delay
                )
                await asyncio.sleep(delay)

    def _body(self, seq: StreamSeq) -> dict[str, Any]:
        p = seq.params
        body: dict[str, Any] = {
            "model": self.upstream_model,
            # resumed and already streamed tokens continue the prompt, as in an unbroken run;
            # a retry after a dropped connection continues the same way
            "prompt": seq.prompt_ids + seq.generated,
            "max_tokens": seq.remaining,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "stream": True,
            "return_token_ids": True,
        }
        if p.top_k:
            body["top_k"] = p.top_k
        if p.ignore_eos:
            body["ignore_eos"] = True
        if not p.greedy:
            body["seed"] = p.seed if p.seed is not None else default_seed(seq.seq_id)
        # Stop strings are matched here on the decoded tokens (so a stop spanning a resume
        # boundary is still found); the upstream streams until we close the stream.
        return body

    async def _stream(self, seq: StreamSeq) -> None:
        assert self._client is not None
        async with self._client.stream("POST", "/v1/completions", json=self._body(seq)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise _http_error(resp)
            async for chunk in _sse_json(resp.aiter_lines()):
                if "error" in chunk:
                    err = chunk["error"]
                    kind = err.get("type") if isinstance(err, dict) else None
                    raise UpstreamError(
                        f"upstream failed the request: {_error_message(chunk)}",
                        retry=False,
                        refused=kind == "invalid_request_error",
                    )
                choices = chunk.get("choices") or []
                if not choices:
                    continue  # a usage-only chunk
                choice = choices[0]
                ids = choice.get("token_ids")
                reason = choice.get("finish_reason")
                if ids is None and (choice.get("text") or reason is None):
                    raise UpstreamError(
                        "the upstream does not return token ids; it must support the "
                        "`return_token_ids` completions extension (vLLM, tokenyard)",
                        retry=False,
                    )
                self.feed(seq, [int(t) for t in ids or ()])
                if seq.done:
                    return  # a stop string or the limit: leaving closes the stream upstream
                if reason is not None:
                    self.close(
                        seq, FinishReason.LENGTH if reason == "length" else FinishReason.STOP
                    )
                    return
        raise httpx.RemoteProtocolError("the upstream stream ended without a finish reason")


def _http_error(resp: httpx.Response) -> UpstreamError:
    """4xx are the request's fault (no retry), except 408/429; 5xx may pass."""
    try:
        message = _error_message(resp.json())
    except (ValueError, TypeError):
        message = resp.text[:300]
    status = resp.status_code
    retry = status >= 500 or status in (408, 429)
    refused = 400 <= status < 500 and not retry
    what = "rejected the request" if refused else "failed"
    return UpstreamError(
        f"upstream {what} (HTTP {status}): {message}", retry=retry, refused=refused
    )


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(body)


async def _sse_json(lines: AsyncIterator[str]) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream's `data:` lines, up to `[DONE]`."""
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        if data:
            value = json.loads(data)
            if isinstance(value, dict):
                yield value
