"""Remote engine: forwards each sequence to an OpenAI-compatible server as a streamed completion.

The upstream (a `vllm serve`, another tokenyard gateway, any server that streams generated
token ids with `return_token_ids`) does the batching; this engine only holds up to
`concurrency` streams open. Prompts go up as token ids and text is decoded here from the
token ids that come back, so stop strings, resume and usage are exact whatever the upstream's
detokenizer does, and a redelivered job continues from prompt + streamed tokens.

The decoding fields go up as vLLM's completions API takes them (OpenAI's penalties,
logit_bias and logprobs; vLLM's repetition_penalty, min_tokens, stop_token_ids, min_p,
allowed_token_ids, bad_words, cache_salt and structured_outputs; the detokenization switches
stay here, where the text is made), and logprobs come back as vLLM renders them with
`return_tokens_as_token_ids` ("token_id:N" for every token, so the alternatives map back to
ids exactly; an upstream that sends token strings instead has them looked up in the
tokenizer). A guide or a presence/frequency penalty depends on everything the sequence
generated, which the upstream cannot be told of a prompt: such a sequence is resumed by
asking again from its prompt alone and checking that the tokens already sent come back first
(greedy, or seeded as every sampled sequence here is), never by continuing out of shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import msgspec
from yarl import URL

from tokenyard.engines.base import EngineCapacity, default_seed
from tokenyard.engines.hf_tokenizer import HFTokenizer, load_hf_tokenizer, resolve_model_path
from tokenyard.engines.streams import NOT_REPEATED, StreamEngine, StreamSeq, replayed_tail
from tokenyard.errors import UpstreamError
from tokenyard.messages import Feature, FinishReason, SamplingParams, TokenLogprob

log = logging.getLogger(__name__)
DRAIN_S = 1.0  # how long an ended stream's last bytes are waited for (they come at once)


class RemoteEngine(StreamEngine):
    """Streams each sequence from an OpenAI-compatible `/v1/completions`; capacity = concurrency."""

    name = "remote"
    # all of them go to the upstream (a vLLM or tokenyard); one that lacks a field refuses
    # the request with a 4xx, which fails the job as refused. Not the prompt's logprobs: the
    # upstream streams, and vLLM gives none to a stream
    features = frozenset(Feature) - {Feature.PROMPT_LOGPROBS}
    # a LoRA adapter's job asks the upstream for the adapter by its name (as vLLM serves
    # adapters: `model: NAME`); the upstream must serve it under that name
    runs_adapters = True

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
        tok = load_hf_tokenizer(resolve_model_path(model, weights=False))  # only its tokenizer
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
        self._session: aiohttp.ClientSession | None = None
        self._endpoint = URL(f"{self.url}/v1/completions")
        self._proxy: str | None = None
        self._slots = asyncio.Semaphore(concurrency)
        self._token_strings: dict[str, int] | None = None  # a token's text -> its id
        self._tabling = asyncio.Lock()  # one thread builds that table

    async def open(self) -> None:
        # aiohttp, not httpx: per streamed request httpx (httpcore, anyio, h11) cost ~1.5 ms
        # of the worker's CPU here, several times what the rest of the worker spends on a job.
        # Keep-alive connections, up to one per slot; a read may wait `timeout_s` for the
        # upstream's next event (a long prefill), the whole stream as long as it runs
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers["Content-Type"] = "application/json"
        self._session = aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(
                limit=self.capacity.max_seqs,
                # the CA certificates httpx (its earlier client) trusted: SSL_CERT_FILE or
                # SSL_CERT_DIR when set, else certifi's bundle
                ssl=httpx.create_ssl_context() if self.url.startswith("https:") else True,
            ),
            timeout=aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=self.timeout_s),
            skip_auto_headers=("User-Agent",),
        )
        self._endpoint = URL(f"{self.url}/v1/completions")  # parsed once, not per request
        self._proxy = env_proxy(self._endpoint)

    async def close_runtime(self) -> None:
        if self._session is not None:
            await self._session.close()

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
            except (aiohttp.ClientError, OSError, TimeoutError, UpstreamError) as exc:
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

    def _body(self, seq: StreamSeq, replay: bool) -> dict[str, Any]:
        p = seq.params
        # resumed and already streamed tokens continue the prompt, as in an unbroken run;
        # a retry after a dropped connection continues the same way. `replay`: the sequence
        # starts over from its prompt, to be checked against what it already sent
        resumed = [] if replay else seq.generated
        body: dict[str, Any] = {
            "model": seq.adapter or self.upstream_model,
            "prompt": seq.prompt_ids + resumed,
            "max_tokens": seq.remaining + len(seq.generated) - len(resumed),
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
        body.update(decoding_fields(p, len(resumed)))
        # Stop strings are matched here on the decoded tokens (so a stop spanning a resume
        # boundary is still found); the upstream streams until we close the stream.
        return body

    async def _stream(self, seq: StreamSeq) -> None:
        assert self._session is not None
        # what the upstream must give back first, when the sequence starts over
        expected = list(seq.generated) if seq.generated and replays(seq.params) else []
        body = _ENCODE(self._body(seq, bool(expected)))
        # no redirect is followed (as httpx followed none): a 3xx fails the attempt
        post = self._session.post(
            self._endpoint, data=body, proxy=self._proxy, allow_redirects=False
        )
        async with post as resp:
            if resp.status != 200:
                raise _http_error(resp.status, await resp.read())
            events = _sse_json(resp.content)
            async for batch in events:
                # the events of one read are fed to the decoder together: a chunk that ends
                # nothing waits for the next one of its read (see `_sse_json`)
                ids_run: list[int] = []
                logprobs_run: list[TokenLogprob] | None = None
                last = len(batch) - 1
                for n, chunk in enumerate(batch):
                    try:
                        got = await self._chunk(seq, chunk, expected)
                    except UpstreamError:
                        # what came before it in this read stands: a sequence it ends is done
                        if self._fed(seq, ids_run, logprobs_run):
                            await self._ended(seq, None, events)
                            return
                        raise
                    reason = None
                    if got is not None:
                        ids, logprobs, reason = got
                        ids_run += ids
                        if logprobs is not None:
                            logprobs_run = [*(logprobs_run or ()), *logprobs]
                    if reason is None and n < last:
                        continue
                    if self._fed(seq, ids_run, logprobs_run):
                        await self._ended(seq, reason, events)
                        return  # a stop string: leaving closes the connection, stopping upstream
                    ids_run, logprobs_run = [], None
                    if reason is not None:
                        if expected:
                            raise UpstreamError(
                                f"the upstream ended sequence {seq.seq_id!r} before repeating "
                                f"the {len(expected)} tokens already sent",
                                retry=False,
                            )
                        self.close(
                            seq, FinishReason.LENGTH if reason == "length" else FinishReason.STOP
                        )
                        await _drain(events)
                        return
        raise StreamCut("the upstream stream ended without a finish reason")

    async def _chunk(
        self, seq: StreamSeq, chunk: dict[str, Any], expected: list[int]
    ) -> tuple[list[int], list[TokenLogprob] | None, str | None] | None:
        """One streamed chunk's new ids, their logprobs and its finish reason (None: a
        usage-only chunk); ids the upstream repeats of a sequence started over are taken off
        `expected`. An error chunk, a chunk without token ids, or a repeat that differs from
        what was sent raise UpstreamError."""
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
            return None
        choice = choices[0]
        raw = choice.get("token_ids")
        reason = choice.get("finish_reason")
        if raw is None and (choice.get("text") or reason is None):
            raise UpstreamError(
                "the upstream does not return token ids; it must support the "
                "`return_token_ids` completions extension (vLLM, tokenyard)",
                retry=False,
            )
        ids = [int(t) for t in raw or ()]
        logprobs = None
        if seq.params.logprobs is not None and ids:
            shown = choice.get("logprobs")
            if seq.params.logprobs and self._token_strings is None and _names_by_text(shown):
                await self._table_token_strings()
            logprobs = self._logprobs(ids, shown, seq.params.logprobs)
        if expected:
            tail = replayed_tail(expected, ids, logprobs)
            if tail is None:
                raise UpstreamError(
                    f"sequence {seq.seq_id!r} cannot resume: {NOT_REPEATED}", retry=False
                )
            ids, logprobs = tail
        return ids, logprobs, reason

    def _fed(self, seq: StreamSeq, ids: list[int], logprobs: list[TokenLogprob] | None) -> bool:
        """Feed a run of chunks' ids (none: nothing to feed); whether the sequence is done."""
        if ids:
            self.feed(seq, ids, logprobs)
        return seq.done

    @staticmethod
    async def _ended(
        seq: StreamSeq, reason: str | None, events: AsyncIterator[list[dict[str, Any]]]
    ) -> None:
        """The sequence is done (a stop string, EOS, its length). If the upstream ends too (it
        was asked for no more tokens than are left), what follows is at most a finish and
        `[DONE]`: read to the end so the connection is kept for the next request; else (a stop
        string) leaving closes the connection, which stops the upstream."""
        if reason is not None or seq.remaining == 0:
            await _drain(events)

    def _logprobs(self, ids: list[int], body: Any, k: int) -> list[TokenLogprob]:
        """A chunk's completions-style logprobs (`token_logprobs`, `top_logprobs`: per token a
        dict token -> logprob, the chosen one among them) as tokenyard's, by position."""
        chosen = body.get("token_logprobs") if isinstance(body, dict) else None
        tops = body.get("top_logprobs") if isinstance(body, dict) else None
        if not isinstance(chosen, list) or len(chosen) != len(ids):
            raise UpstreamError(
                f"the upstream sent logprobs for {len(chosen or ())} of {len(ids)} tokens",
                retry=False,
            )
        out = []
        for i, token_id in enumerate(ids):
            top: tuple[tuple[int, float], ...] = ()
            alternatives = tops[i] if isinstance(tops, list) and i < len(tops) else None
            if k and isinstance(alternatives, dict):
                # up to k + 1: the k most likely and the chosen one, wherever it ranks
                named = ((float(lp), self._token_id(t, token_id)) for t, lp in alternatives.items())
                # an alternative whose text names no token (a byte rendering) is left out
                ranked = sorted(((lp, t) for lp, t in named if t is not None), key=lambda x: -x[0])
                top = tuple((t, lp) for lp, t in ranked[:k])
            out.append(TokenLogprob(token_id, float(chosen[i]), top))
        return out

    def _token_id(self, token: str, chosen: int) -> int | None:
        """A token as the upstream names it: "token_id:N" (vLLM's `return_tokens_as_token_ids`),
        else its text, looked up among the tokenizer's single-token texts (the chosen token's
        own text is it; of several tokens with one text the lowest id); None: no token's."""
        if token.startswith("token_id:"):
            return int(token[len("token_id:") :])
        tok = self.tokenizer
        if tok.decode([chosen]) == token:
            return chosen
        # tabled (off the loop) before a chunk that names tokens by text is read
        assert self._token_strings is not None, "token texts not tabled"
        return self._token_strings.get(token)

    async def _table_token_strings(self) -> None:
        """Table every token's text (one decode per vocabulary entry: seconds for a large
        vocabulary) in a thread, once; `convert_ids_to_tokens` would give the BPE pieces
        ("Ġthe"), not the texts an upstream names."""
        async with self._tabling:
            if self._token_strings is None:
                self._token_strings = await asyncio.to_thread(_token_strings, self.tokenizer)


def _token_strings(tok: HFTokenizer) -> dict[str, int]:
    """Each single-token text -> its token id (of several tokens with one text, the lowest)."""
    strings: dict[str, int] = {}
    for i in range(tok.vocab_size - 1, -1, -1):  # the lowest id of a text wins
        strings[tok.decode([i])] = i
    return strings


def _names_by_text(logprobs: Any) -> bool:
    """Whether a chunk's logprobs name alternatives by text rather than as "token_id:N"."""
    tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    return isinstance(tops, list) and any(
        isinstance(top, dict) and any(not t.startswith("token_id:") for t in top) for top in tops
    )


def replays(params: SamplingParams) -> bool:
    """Decoding that depends on the tokens generated so far: resumed, the sequence is asked
    again from its prompt (the upstream would take resumed tokens as prompt, not output)."""
    return params.depends_on_output


def decoding_fields(p: SamplingParams, resumed: int) -> dict[str, Any]:
    """The optional decoding fields of a request, as vLLM's completions API takes them;
    `resumed` tokens of the output are in the prompt, and count towards min_tokens."""
    body: dict[str, Any] = {}
    if p.presence_penalty:
        body["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        body["frequency_penalty"] = p.frequency_penalty
    if p.repetition_penalty != 1.0:
        body["repetition_penalty"] = p.repetition_penalty
    if p.logit_bias:
        body["logit_bias"] = {str(t): bias for t, bias in p.logit_bias}
    if min_tokens := p.min_tokens_left(resumed):
        body["min_tokens"] = min_tokens
    if p.stop_token_ids:
        body["stop_token_ids"] = list(p.stop_token_ids)
    if p.logprobs is not None:
        body["logprobs"] = p.logprobs
        body["return_tokens_as_token_ids"] = True
    if p.min_p:
        body["min_p"] = p.min_p
    if p.allowed_token_ids:
        body["allowed_token_ids"] = list(p.allowed_token_ids)
    if p.bad_words:
        body["bad_words"] = list(p.bad_words)
    if p.cache_salt is not None:
        body["cache_salt"] = p.cache_salt
    if p.guide is not None:
        kind, value = p.guide.field
        if kind == "json":
            value = json.loads(value)
        elif kind == "choice":
            value = list(value)
        body["structured_outputs"] = {kind: value}
    return body


def _http_error(status: int, content: bytes) -> UpstreamError:
    """4xx are the request's fault (no retry), except 408/429; 5xx may pass."""
    try:
        message = _error_message(json.loads(content))
    except (ValueError, TypeError):
        message = content[:300].decode("utf-8", "replace")
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


def env_proxy(url: URL) -> str | None:
    """The proxy that HTTP_PROXY / HTTPS_PROXY / ALL_PROXY name for `url`, unless NO_PROXY
    exempts its host, as httpx (this engine's earlier client) honoured them; looked up once,
    where aiohttp's `trust_env` would read the environment again per request."""
    proxies = urllib.request.getproxies_environment()
    if not url.host or urllib.request.proxy_bypass(url.host):  # NO_PROXY (on Linux)
        return None
    return proxies.get(url.scheme) or proxies.get("all")


class StreamCut(ConnectionError):
    """The upstream's stream ended (its connection closed) before the sequence's end: a
    transport failure, retried from the tokens streamed so far."""


_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.Decoder().decode


async def _sse_json(content: aiohttp.StreamReader) -> AsyncIterator[list[dict[str, Any]]]:
    """The JSON payloads of an SSE stream's `data:` lines up to `[DONE]`, those of one socket
    read together (an upstream under load, or one that answers at once, sends several events in
    one read: the engine feeds them to the decoder in one go, as if the upstream had sent one
    chunk of several tokens); then the response is read to its end, so that aiohttp keeps its
    connection. Lines are split here from whatever the socket gave (a line may be longer than
    aiohttp's readline allows: a chunk of many logprobs)."""
    buffer = b""
    done = False
    async for data in content.iter_any():
        if done:
            continue
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        batch: list[dict[str, Any]] = []
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            if payload:
                value = _DECODE(payload)
                if isinstance(value, dict):
                    batch.append(value)
        if batch:
            yield batch


async def _drain(events: AsyncIterator[list[dict[str, Any]]]) -> None:
    """Read an ended stream's last events (a usage chunk, `[DONE]`) and the response's end,
    so that aiohttp keeps its connection for the next request. The sequence's finish is out
    already; an upstream slow to end its response holds the slot up to DRAIN_S, then loses
    its connection (closed when the caller leaves)."""
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
        async with asyncio.timeout(DRAIN_S):
            async for _ in events:
                pass
