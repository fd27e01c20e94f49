"""Reasoning parsers: a reasoning model's answer → its reasoning and its content, whole or
streamed, with the content then read for tool calls (reasoning first, then content and calls).

The formats are vLLM's `--reasoning-parser` names, both `<think>…</think>`:

- `deepseek_r1`: the answer opens in reasoning whether or not the model writes `<think>`
  (DeepSeek-R1's template puts it in the prompt); `</think>` ends it. No `</think>`: the whole
  answer is reasoning (cut off while thinking).
- `qwen3`: the same, and `<tool_call>` before `</think>` ends the reasoning too (Qwen3.5 may
  call a tool without closing its thinking; the call is then read as one). The chat template's
  `enable_thinking` false leaves no reasoning to read: the answer is all content.

A prompt whose template already closed the reasoning (it ends with `</think>`, as Qwen3's
does for `enable_thinking` false) is read as content only, as vLLM reads it.

One incremental machine does both the whole and the streamed split, as the tool parsers do:
text that may still be a tag (`</thi` at the end of a delta) is held back until it is known,
so a streamed answer carries exactly the reasoning and content of the non-streamed one,
however its text was split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenyard.gateway.tools.parsers import (
    CallStream,
    ContentDelta,
    Delta,
    Parsed,
    ToolCall,
    ToolCallStream,
    held_suffix,
    parse_calls,
)
from tokenyard.messages import ReasoningReading

# vLLM's names for --reasoning-parser that tokenyard reads
REASONING_PARSERS = ("deepseek_r1", "qwen3")
THINK = "<think>"
END_THINK = "</think>"
_TOOL_CALL = "<tool_call>"  # qwen3: an implicit end of the reasoning


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


AnswerDelta = Delta | ReasoningDelta


class ReasoningStream:
    """The reasoning of one answer, split off as it streams: `feed` each text delta, then
    `finish`. The content after the reasoning goes to `calls` (a tool-call stream) when the
    answer is read for calls, else it is content as it comes. `include` false (the request's
    `include_reasoning`) drops the reasoning from what is handed out."""

    def __init__(self, parser: str, calls: CallStream | None = None, include: bool = True):
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}")
        self.parser = parser
        self.inner = calls
        self.include = include
        self._ends = (END_THINK, _TOOL_CALL) if parser == "qwen3" else (END_THINK,)
        self._thinking = True  # still inside the reasoning
        self._opened = False  # the opening <think> was met, or ruled out
        self._held = ""  # text that may still be a tag
        self.content: list[str] = []  # the content text handed on, as the model wrote it

    @property
    def calls(self) -> list[ToolCall]:
        return [] if self.inner is None else self.inner.calls

    @property
    def broken(self) -> bool:
        return self.inner is not None and self.inner.broken

    def feed(self, text: str) -> list[AnswerDelta]:
        return self._kept(self._split(text, final=False))

    def finish(self) -> list[AnswerDelta]:
        """The end of the answer: held text is what it was held in (reasoning, if the answer
        never left it), and the content's reader ends."""
        out = self._split("", final=True)
        if self.inner is not None:
            out.extend(self.inner.finish())
        return self._kept(out)

    def _kept(self, deltas: list[AnswerDelta]) -> list[AnswerDelta]:
        if self.include:
            return deltas
        return [d for d in deltas if not isinstance(d, ReasoningDelta)]

    def _split(self, text: str, final: bool) -> list[AnswerDelta]:
        out: list[AnswerDelta] = []
        buf, self._held = self._held + text, ""
        while buf and self._thinking:
            if not self._opened:
                body = buf.lstrip()
                if body.startswith(THINK):  # the tag and the whitespace before it are dropped
                    buf, self._opened = body[len(THINK) :], True
                    continue
                if not final and THINK.startswith(body):  # (whitespace alone, or a tag's start)
                    self._held = buf
                    return out
                self._opened = True
            found = [(at, tag) for tag in self._ends if (at := buf.find(tag)) >= 0]
            if found:
                at, tag = min(found)
                if at:
                    out.append(ReasoningDelta(buf[:at]))
                self._thinking = False
                # `</think>` is dropped; an implicit end's `<tool_call>` is the content's start
                buf = buf[at + len(tag) :] if tag == END_THINK else buf[at:]
                break
            keep = 0 if final else held_suffix(buf, self._ends)
            if len(buf) > keep:
                out.append(ReasoningDelta(buf[: len(buf) - keep]))
            self._held = buf[len(buf) - keep :]
            return out
        if buf:
            self.content.append(buf)
            out.extend(self.inner.feed(buf) if self.inner is not None else [ContentDelta(buf)])
        return out


Reader = CallStream | ReasoningStream


def reasoning_reading(
    parser: str, prompt: str, template_kwargs: Mapping[str, Any], include: bool = True
) -> ReasoningReading | None:
    """How a chat job's answer is split (the one decision; a job keeps it in
    `JobSpec.reasoning`): None without a parser, or when the prompt leaves no reasoning to
    read (its template closed it: thinking off)."""
    if not parser:
        return None
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}")
    if prompt.rstrip().endswith(END_THINK):
        return None
    if parser == "qwen3" and template_kwargs.get("enable_thinking") is False:
        return None
    return ReasoningReading(parser=parser, include=include)


def reasoning_reader(reading: ReasoningReading, calls: CallStream | None) -> ReasoningStream:
    """A fresh stream splitting one answer as `reading` says, its content read by `calls`."""
    return ReasoningStream(reading.parser, calls, reading.include)


def parse_whole(reader: Reader, text: str) -> Parsed:
    """A whole answer through a fresh reader: its reasoning (None when not read, or not
    included), its content (None when empty after reasoning, as vLLM answers) and its calls.
    A call that broke leaves the content's whole text as content, with no calls."""
    if not isinstance(reader, ReasoningStream):
        return parse_calls(reader, text)
    deltas = [*reader.feed(text), *reader.finish()]
    reasoning = None
    if reader.include:
        reasoning = "".join(d.text for d in deltas if isinstance(d, ReasoningDelta))
    said = "".join(reader.content)
    inner = reader.inner
    if inner is None or (inner.broken and isinstance(inner, ToolCallStream)):
        return Parsed(said or None, [], reasoning)
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    return Parsed(content or None, inner.calls, reasoning)
