"""Server-sent events: frames per wire format and the response that carries them; the SSE id of
a frame is the broker event id."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenyard.errors import InvalidRequest
from tokenyard.gateway import protocol
from tokenyard.gateway.errors import error_body
from tokenyard.gateway.tools import AnswerDelta, ContentDelta, Reader, ReasoningDelta
from tokenyard.messages import JobResult, TokenChunk

_json = msgspec.json.Encoder()
KEEPALIVE_FRAME = b": keep-alive\n\n"
DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(data: Any, event_id: str | None = None, event: str | None = None) -> bytes:
    """One SSE frame; `data` is JSON-encoded unless it is already bytes."""
    head = b""
    if event_id is not None:
        head += b"id: " + event_id.encode() + b"\n"
    if event is not None:
        head += b"event: " + event.encode() + b"\n"
    body = data if isinstance(data, bytes) else _json.encode(data)
    return head + b"data: " + body + b"\n\n"


class Renderer(Protocol):
    """Turns job events into SSE frames for one wire format."""

    def start(self) -> list[bytes]: ...

    def tokens(self, event_id: str, chunk: TokenChunk) -> list[bytes]: ...

    def finish(self, event_id: str, result: JobResult) -> list[bytes]: ...

    def ended(self) -> list[bytes]:
        """The stream ended without a Finished event (it was seen before the resume point)."""
        ...

    def failure(self, message: str, code: str, status: int) -> list[bytes]: ...


@dataclass(frozen=True)
class ChunkHead:
    """What every chunk of one OpenAI stream repeats: the object kind, the call's id, the model
    answered as, and when it was created. A call's choices share it, so their chunks merge."""

    kind: protocol.Kind
    job_id: str
    model: str
    created: int

    def chunk(self, **fields: Any) -> dict[str, Any]:
        return protocol.chunk_body(self.kind, self.job_id, self.model, self.created, **fields)


class OpenAIRenderer:
    """OpenAI completion or chat chunks of choice `index`, then `data: [DONE]`; one of a call's
    several choices renders into their `Choices`, which ends the merged stream instead."""

    def __init__(
        self,
        head: ChunkHead,
        *,
        include_usage: bool,
        resumed: bool,
        how: protocol.Rendering = protocol.PLAIN,
        index: int = 0,
        choices: Choices | None = None,
        tools: Reader | None = None,
    ) -> None:
        self.head, self.kind = head, head.kind
        self.include_usage = include_usage
        self.resumed = resumed
        self.how = how
        self.index = index
        self.choices = choices
        self.offset = 0  # completions' text_offset: where the next token's text starts
        # reads the chat answer for its reasoning and tool calls (a fresh stream: one
        # renderer, one answer)
        self.tools = tools

    @property
    def carries_state(self) -> bool:
        """Whether what it renders depends on the events before (a resumed stream must
        replay them first): a reasoning or tool parser's progress, completions'
        `text_offset`."""
        return self.tools is not None or (
            self.kind == "completion" and self.how.token_text is not None
        )

    def _chunk(self, event_id: str | None, **fields: Any) -> bytes:
        body = self.head.chunk(index=self.index, **fields)
        # a merged stream interleaves several jobs' events: no one event id resumes it
        return frame(body, None if self.choices is not None else event_id)

    def start(self) -> list[bytes]:
        # the role chunk precedes every event, so a resumed stream has already had it
        if self.resumed:
            return []
        if self.kind == "chat":
            return [self._chunk(None, role=True)]
        if self.how.echo:
            return [self._chunk(None, text=self.how.echo)]
        return []

    def tokens(self, event_id: str, chunk: TokenChunk) -> list[bytes]:
        logprobs = protocol.choice_logprobs(self.kind, chunk.logprobs, self.how, self.offset)
        if logprobs is not None and self.kind == "completion":
            self.offset += sum(map(len, logprobs["tokens"]))
        if self.tools is not None:
            deltas = self.tools.feed(chunk.text)
            return self._tool_chunks(event_id, deltas, chunk.token_ids, logprobs)
        if self.how.token_ids:
            return [
                self._chunk(event_id, text=chunk.text, token_ids=chunk.token_ids, logprobs=logprobs)
            ]
        if not chunk.text and logprobs is None:
            return []  # an incomplete UTF-8 character; its text arrives with a later event
        return [self._chunk(event_id, text=chunk.text, logprobs=logprobs)]

    def finish(self, event_id: str, result: JobResult) -> list[bytes]:
        failed = protocol.result_error(result)
        if failed is not None:
            return self._failed(frame(failed[1], event_id))
        reason = protocol.openai_finish_reason(result.finish_reason)
        ids: list[int] | None = [] if self.how.token_ids else None
        frames = []
        if self.tools is not None:
            # text held back as maybe a call's or a tag's start is what it was after all
            frames = self._tool_chunks(None, self.tools.finish(), None, None)
            if self.tools.calls:
                reason = protocol.tool_calls_finish_reason(reason)
        frames.append(self._chunk(event_id, finish_reason=reason, token_ids=ids))
        if self.choices is not None:
            self.choices.results[self.index] = result
            return frames
        if self.include_usage:
            frames.append(self._chunk(None, usage_of=[result], no_choices=True))
        return [*frames, DONE_FRAME]

    def _tool_chunks(
        self,
        event_id: str | None,
        deltas: Sequence[AnswerDelta],
        token_ids: list[int] | None,
        logprobs: dict[str, Any] | None,
    ) -> list[bytes]:
        """A chunk per piece of reasoning, of content or of a call; the event id (the resume
        point), the token ids and their logprobs go on the last, which may carry nothing else
        (its text is held back)."""
        pieces: list[dict[str, Any]] = [
            {"text": d.text}
            if isinstance(d, ContentDelta)
            else {"reasoning": d.text}
            if isinstance(d, ReasoningDelta)
            else {"tool_calls": [d.openai()]}
            for d in deltas
        ]
        if self.how.token_ids and token_ids is not None:
            pieces = pieces or [{}]
            pieces[-1]["token_ids"] = token_ids
        if logprobs is not None:
            pieces = pieces or [{}]
            pieces[-1]["logprobs"] = logprobs
        last = len(pieces) - 1
        return [self._chunk(event_id if i == last else None, **p) for i, p in enumerate(pieces)]

    def ended(self) -> list[bytes]:
        return [] if self.choices is not None else [DONE_FRAME]

    def failure(self, message: str, code: str, status: int) -> list[bytes]:
        type_ = "timeout_error" if status == 504 else "server_error"
        return self._failed(frame(error_body(message, type_, None, code)))

    def _failed(self, error: bytes) -> list[bytes]:
        if self.choices is not None:
            self.choices.fail(error)
            return []
        return [error, DONE_FRAME]


class Choices:
    """The choices of one streamed call (`n` of each prompt), each its own job: their results
    (the usage chunk sums them) and the first failure, which fails the whole call."""

    def __init__(
        self,
        head: ChunkHead,
        n: int,
        *,
        include_usage: bool,
        per_prompt: int | None = None,
    ) -> None:
        self.head = head
        self.n = n
        self.per_prompt = per_prompt  # choices of each prompt (a batched completions call)
        self.include_usage = include_usage
        self.results: dict[int, JobResult] = {}
        self.failure: bytes | None = None

    def fail(self, error: bytes) -> None:
        if self.failure is None:
            self.failure = error

    def end(self) -> list[bytes]:
        """The frames after the last choice's: the error, or the summed usage; then [DONE]."""
        if self.failure is not None:
            return [self.failure, DONE_FRAME]
        frames: list[bytes] = []
        if self.include_usage and len(self.results) == self.n:
            results = [self.results[i] for i in range(self.n)]
            body = self.head.chunk(
                usage_of=results,
                per_prompt=self.per_prompt,
                no_choices=True,
            )
            frames.append(frame(body))
        return [*frames, DONE_FRAME]


async def merged(
    children: Sequence[AsyncGenerator[bytes, None]], choices: Choices
) -> AsyncGenerator[bytes, None]:
    """One SSE stream of several choices' frames, as they come; the first failure ends it
    (and every other choice's job is left, so cancelled), as does the client leaving. Prime
    it with `primed`: its first item is an empty frame."""
    inbox: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: a child ended

    async def pump(frames: AsyncGenerator[bytes, None]) -> None:
        try:
            async for f in frames:
                inbox.put_nowait(f)
        finally:
            inbox.put_nowait(None)

    # tasks of their own, not a task group: the response closes this generator from another
    # task than the one that iterated it, which a cancel scope held across a yield forbids
    tasks = [asyncio.create_task(pump(child)) for child in children]
    try:
        yield b""
        running = len(tasks)
        while running and choices.failure is None:
            f = await inbox.get()
            if f is None:
                running -= 1
            elif f:
                yield f
        for f in choices.end():
            yield f
    finally:
        for task in tasks:
            task.cancel()  # once: a second cancel would cut short its job's cancellation
        # the response's cancel scope cancels every await here again and again, and a
        # cancelled gather cancels the tasks it gathers: shield the wait for their cleanup
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)
            for child in children:  # one whose task never ran still holds its job
                await child.aclose()


class JobRenderer:
    """The job's own events: `event: tokens` and a final `event: finish` with the result;
    `token_text` names the tokens of a job's logprobs."""

    def __init__(self, token_text: Callable[[int], str] | None = None) -> None:
        self.token_text = token_text

    def start(self) -> list[bytes]:
        return []

    def tokens(self, event_id: str, chunk: TokenChunk) -> list[bytes]:
        body = protocol.token_event_body(chunk, self.token_text)
        return [frame(body, event_id, "tokens")]

    def finish(self, event_id: str, result: JobResult) -> list[bytes]:
        return [frame(protocol.result_json(result), event_id, "finish")]

    def ended(self) -> list[bytes]:
        return []

    def failure(self, message: str, code: str, status: int) -> list[bytes]:
        return [frame(error_body(message, "server_error", None, code), event="error")]


async def primed(frames: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """Run a stream up to its priming frame, so its cleanup runs even if the client leaves
    before the first real frame (closing a generator that never started skips its finally)."""
    await frames.__anext__()
    return frames


class EventStreamResponse(StreamingResponse):
    """An SSE response that always watches for the client leaving, whatever the ASGI version.

    On a disconnect the body generator is closed at once, so its cleanup (cancelling an
    abandoned job) runs now rather than when the generator is garbage-collected.
    """

    def __init__(self, content: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={**SSE_HEADERS, **headers}
        )
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    # OSError: the client left mid-write; the watcher sees it too
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._generator.aclose()


_EVENT_ID_PART_MAX = (1 << 64) - 1  # each part of a broker event id is an unsigned 64-bit int
_EVENT_ID_PART_DIGITS = len(str(_EVENT_ID_PART_MAX))


def _event_id_part(text: str) -> bool:
    # str.isdigit() also says yes to other scripts' digits (and int() reads them); the length
    # first, as int() refuses a string of more than 4,300 digits with a ValueError
    return (
        text.isascii()
        and text.isdigit()
        and len(text) <= _EVENT_ID_PART_DIGITS
        and int(text) <= _EVENT_ID_PART_MAX
    )


def last_event_id(request: Request, after: str | None) -> str:
    """Resume point: the Last-Event-ID header, else an `after` query value, else the start.
    Anything but an event id (`ms` or `ms-seq`, each part an unsigned 64-bit int) is 400,
    answered before the stream starts."""
    header = request.headers.get("last-event-id")
    param = "Last-Event-ID" if header else "after"
    value = (header or after or "0").strip()
    ms, dash, seq = value.partition("-")
    if _event_id_part(ms) and (not dash or _event_id_part(seq)):
        return value
    raise InvalidRequest(
        f"{param} must be an event id: 'ms' or 'ms-seq', each part an unsigned 64-bit "
        f"integer in ASCII digits, not {value[:80]!r}",
        param=param,
        code="invalid_value",
    )
