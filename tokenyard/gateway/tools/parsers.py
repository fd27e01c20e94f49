"""Tool-call parsers: a model's text → its content and OpenAI tool calls, whole or streamed.

The formats are vLLM's `--tool-call-parser` names:

- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": .., "arguments": {..}}</tool_call>`,
  anywhere in the text, any number of them;
- `llama3_json` (Llama 3.1+): the whole answer is `{"name": .., "parameters": {..}}`,
  optionally after `<|python_tag|>`, several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]`. The marker is a special
  token that detokenizing with `skip_special_tokens` drops, so an answer that starts with `[`
  is read as the array too.

Two more serve `tool_choice` when decoding is constrained (the output's shape is then known):
`required` (a JSON array of `{"name", "parameters"}`, vLLM's schema) and `named` (the output
is the named function's arguments).

One incremental machine does both the whole and the streamed parse: the whole parse is the
stream fed at once, so a streamed answer carries exactly the calls and content of the
non-streamed one, however its text was split. A call is announced (id and name) as soon as its
name is read and its arguments follow as they arrive; text that may still open a call (a
partial marker, a block not yet known to be a call) is held back, never sent as content.
"""

from __future__ import annotations

import enum
import hashlib
import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

# vLLM's names for --tool-call-parser, and `auto` (chosen from the chat template's text)
PARSER_NAMES = ("auto", "hermes", "llama3_json", "mistral")
ParserName = Literal["hermes", "llama3_json", "mistral"]

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` and 24 random letters and digits, as OpenAI's tool call ids look."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def stable_call_ids(seed: str) -> Callable[[], str]:
    """Call ids drawn from `seed` (a job id): every reading of one answer names its calls
    alike, so a stream resumed on another gateway, or a stored answer read again, keeps
    the ids a client already has."""
    count = 0

    def make() -> str:
        nonlocal count
        digest = hashlib.sha256(f"{seed}:{count}".encode()).digest()
        count += 1
        number = int.from_bytes(digest, "big")
        chars = []
        for _ in range(24):
            number, at = divmod(number, len(_ID_ALPHABET))
            chars.append(_ID_ALPHABET[at])
        return "call_" + "".join(chars)

    return make


@dataclass
class ToolCall:
    """One parsed call; `arguments` is JSON text, as the model wrote it."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The call as a chat completion's `message.tool_calls` item."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallDelta:
    """A streamed piece of call `index`: its announcement (id and name, arguments "") or a
    fragment of its arguments (id and name None)."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict[str, Any]:
        """The piece as a chunk's `delta.tool_calls` item."""
        if self.id is None or self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Delta = ContentDelta | CallDelta


@dataclass(frozen=True)
class Parsed:
    """A whole answer: its content (None when it is only calls), its calls, and its reasoning
    (None unless a reasoning parser read some out of it)."""

    content: str | None
    calls: list[ToolCall]
    reasoning: str | None = None


class ToolParserError(ValueError):
    """The server cannot tell how this model writes tool calls (a configuration error)."""


def choose_parser(setting: str, chat_template: str) -> ParserName:
    """The parser to use: the setting, or with `auto` the one the chat template's text shows."""
    if setting in ("hermes", "llama3_json", "mistral"):
        return setting  # type: ignore[return-value]
    if setting != "auto":
        raise ToolParserError(
            f"unknown tool call parser {setting!r}; expected one of {', '.join(PARSER_NAMES)}"
        )
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or "<|eom_id|>" in chat_template:
        return "llama3_json"
    raise ToolParserError(
        "cannot tell from this model's chat template how it writes tool calls; start the "
        "gateway with --tool-call-parser hermes, llama3_json or mistral "
        "(TOKENYARD_GATEWAY_TOOL_CALL_PARSER)"
    )


# -- one JSON value, read a character at a time ------------------------------------------------
class _Value:
    """Finds where a JSON value ends, watching strings and nesting (json.loads judges it)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.done = False
        self._kind = ""  # "container", "string" or "scalar"
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, ch: str) -> bool:
        """Take `ch`; False when it is not part of the value (a scalar's end), which is then
        done. The caller skips whitespace before the value starts."""
        if not self._kind:
            self._kind = "container" if ch in "{[" else "string" if ch == '"' else "scalar"
            if self._kind == "string":
                self._in_string = True
        elif self._kind == "scalar":
            if ch in ",]}" or ch.isspace():
                self.done = True
                return False
        elif self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                if self._kind == "string":
                    self.done = True
        elif ch == '"':
            self._in_string = True
        self.text.append(ch)
        if self._kind == "container" and not self._in_string:
            if ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.done = self._depth == 0
        return True


class _Step(enum.Enum):
    OPEN = enum.auto()  # before `{`
    KEY_OR_END = enum.auto()  # after `{`
    KEY = enum.auto()
    COLON = enum.auto()
    VALUE = enum.auto()
    COMMA_OR_END = enum.auto()
    KEY_NEXT = enum.auto()  # after `,`: a key must follow


_ARGUMENT_KEYS = ("arguments", "parameters")


class _CallObject:
    """One `{"name": .., "arguments": {..}}` object, read a character at a time.

    `name` is set once its string is read; the arguments' raw text is kept as it arrives
    (`pending` holds what has not been handed out). `failed`: this is not a call, or not JSON.
    """

    def __init__(self) -> None:
        self.step = _Step.OPEN
        self.name: str | None = None
        self.arguments: list[str] = []
        self.pending: list[str] = []
        self.done = False
        self.failed = False
        self._key: list[str] = []
        self._key_escaped = False
        self._current = ""
        self._value: _Value | None = None
        self._have_arguments = False
        self.call: ToolCall | None = None  # once announced

    def feed(self, ch: str) -> bool:
        """Take `ch`; False when it was not consumed (the object ended, or failed, before it)."""
        if self.done or self.failed:
            return False
        step = self.step
        if step is _Step.VALUE:
            assert self._value is not None
            if not self._value.text and ch.isspace():
                return True
            consumed = self._value.feed(ch)
            if consumed and self._current in _ARGUMENT_KEYS and not self._have_arguments:
                if not self.arguments and ch != "{":
                    self.failed = True  # arguments must be an object
                    return False
                self.arguments.append(ch)
                self.pending.append(ch)
            if self._value.done:
                self._end_value()
            return True if consumed else self.feed(ch)
        if ch.isspace() and step is not _Step.KEY:
            return True
        if step is _Step.OPEN:
            return self._expect(ch == "{", _Step.KEY_OR_END)
        if step in (_Step.KEY_OR_END, _Step.KEY_NEXT):
            if ch == "}" and step is _Step.KEY_OR_END:
                return self._close()
            return self._expect(ch == '"', _Step.KEY)
        if step is _Step.KEY:
            self._key.append(ch)
            if self._key_escaped:
                self._key_escaped = False
            elif ch == "\\":
                self._key_escaped = True
            elif ch == '"':
                try:
                    self._current = json.loads('"' + "".join(self._key))
                except ValueError:
                    self.failed = True
                    return False
                self._key = []
                self.step = _Step.COLON
            return True
        if step is _Step.COLON:
            if ch == ":":
                self._value = _Value()
            return self._expect(ch == ":", _Step.VALUE)
        # COMMA_OR_END
        if ch == "}":
            return self._close()
        return self._expect(ch == ",", _Step.KEY_NEXT)

    def _expect(self, ok: bool, then: _Step) -> bool:
        if not ok:
            self.failed = True
            return False
        self.step = then
        return True

    def _end_value(self) -> None:
        assert self._value is not None
        raw = "".join(self._value.text)
        try:
            value = json.loads(raw)
        except ValueError:
            self.failed = True
            return
        if self._current == "name" and self.name is None:
            if not isinstance(value, str) or not value:
                self.failed = True
                return
            self.name = value
        elif self._current in _ARGUMENT_KEYS and not self._have_arguments:
            if not isinstance(value, dict):
                self.failed = True
                return
            self._have_arguments = True
        self._current = ""
        self._value = None
        self.step = _Step.COMMA_OR_END

    def _close(self) -> bool:
        if self.name is None:
            self.failed = True  # a JSON object, but not a call
            return False
        if not self.arguments:  # a function without parameters may be called without them
            self.arguments.append("{}")
            self.pending.append("{}")
        self.done = True
        return True

    def take(self) -> str:
        """The arguments' text read since the last take."""
        out = "".join(self.pending)
        self.pending = []
        return out


# -- the formats --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Format:
    markers: tuple[str, ...] = ()  # open calls anywhere in the text (consumed)
    leads: tuple[str, ...] = ()  # open calls only as the answer's first text (kept)
    after_marker: Literal["object", "array", "objects"] = "object"
    close: str = ""  # what ends a block after its object (hermes)


_FORMATS: dict[str, _Format] = {
    "hermes": _Format(markers=("<tool_call>",), after_marker="object", close="</tool_call>"),
    # `<|python_tag|>` is dropped by skip_special_tokens; then the answer starts with `{`
    "llama3_json": _Format(leads=("<|python_tag|>", "{"), after_marker="objects"),
    "mistral": _Format(markers=("[TOOL_CALLS]",), leads=("[",), after_marker="array"),
    "required": _Format(leads=("[",), after_marker="array"),
}


class _Mode(enum.Enum):
    OUTSIDE = enum.auto()
    ARRAY_OPEN = enum.auto()  # after a marker/lead, before `[` (or one bare object)
    OBJECT = enum.auto()
    AFTER = enum.auto()  # after an object: a separator, a closer, or the end of the block
    SKIP = enum.auto()  # a call that was announced broke: the rest of its block is dropped


@dataclass
class _Announced:
    call: ToolCall
    complete: bool = False


@dataclass
class ToolCallStream:
    """The incremental parser of one answer: `feed` each text delta, then `finish`.

    `make_id` names calls (tests pass a deterministic one). `max_calls` keeps only the first
    calls (`parallel_tool_calls` false: vLLM keeps the first); the others are still read, so
    their text is no content.
    """

    parser: str
    make_id: Callable[[], str] = new_call_id
    max_calls: int | None = None
    _calls: list[_Announced] = field(default_factory=list)
    _cut: bool = False  # a block with calls went wrong outside any announced call
    _buf: str = ""
    _pos: int = 0  # where reading _buf is
    _pending: str = ""  # outside text not yet sent as content
    _at_start: bool = True  # no text but whitespace seen yet
    _mode: _Mode = _Mode.OUTSIDE
    _in_array: bool = False
    _object: _CallObject | None = None
    _raw: str = ""  # the current block's text, content if it is not a call after all
    _block_announced: bool = False

    def __post_init__(self) -> None:
        self._format = _FORMATS[self.parser]

    @property
    def calls(self) -> list[ToolCall]:
        return [a.call for a in self._calls[: self.max_calls]]

    @property
    def broken(self) -> bool:
        """A call was announced but its text turned out not to be a valid call (cut by
        max_tokens, or malformed)."""
        kept = self._calls[: self.max_calls]
        more = self.max_calls is None or len(self._calls) < self.max_calls
        return any(not a.complete for a in kept) or (self._cut and more)

    def feed(self, text: str) -> list[Delta]:
        self._push_back("", text)
        out: list[Delta] = []
        self._run(out, final=False)
        return self._kept(out)

    def _kept(self, deltas: list[Delta]) -> list[Delta]:
        limit = self.max_calls
        if limit is not None:
            deltas = [d for d in deltas if not isinstance(d, CallDelta) or d.index < limit]
        return _merged(deltas)

    def finish(self) -> list[Delta]:
        """The end of the answer: held text is content, an unfinished call breaks."""
        out: list[Delta] = []
        self._run(out, final=True)
        if self._mode in (_Mode.OBJECT, _Mode.ARRAY_OPEN):
            if self._block_announced:
                self._cut = True
            else:
                self._give_back(out, "")
                self._run(out, final=True)
        self._mode = _Mode.OUTSIDE
        held, self._pending = self._pending, ""
        if held and (not self._calls or held.strip()):
            out.append(ContentDelta(held.rstrip() if self._calls else held))
        return self._kept(out)

    def _push_back(self, text: str, then: str = "") -> None:
        self._buf = text + self._buf[self._pos :] + then
        self._pos = 0

    def _run(self, out: list[Delta], final: bool) -> None:
        while self._pos < len(self._buf):
            if self._mode is _Mode.OUTSIDE:
                if not self._outside(out, final):
                    return
                continue
            ch = self._buf[self._pos]
            self._pos += 1
            self._char(ch, out)

    def _outside(self, out: list[Delta], final: bool) -> bool:
        """Outside any call: find where one opens and send the text before it as content;
        False when all the text is read (some may be held)."""
        fmt = self._format
        text = self._pending + self._buf[self._pos :]
        self._pending, self._buf, self._pos = "", "", 0
        if self._at_start:
            body = text.lstrip()
            maybe = (*fmt.leads, *fmt.markers)
            if not body or (not final and any(x != body and x.startswith(body) for x in maybe)):
                self._pending = text  # a lead or marker may still be arriving
                return False
            self._at_start = False
            if not body.startswith(fmt.markers):
                for lead in fmt.leads:
                    if body.startswith(lead):
                        self._open_block(text[: len(text) - len(body)], body, lead)
                        return True
        found = [(text.find(m), m) for m in fmt.markers if m in text]
        if found:
            at, marker = min(found)
            before = text[:at]
            body = before.rstrip()
            if body:
                out.append(ContentDelta(body))
            # the whitespace before a call is no content, unless the block is not a call
            self._raw = before[len(body) :] + marker
            self._push_back("", text[at + len(marker) :])
            self._block_announced = self._in_array = False
            if fmt.after_marker == "array":
                self._mode, self._object = _Mode.ARRAY_OPEN, None
            else:
                self._mode, self._object = _Mode.OBJECT, _CallObject()
            return True
        keep = 0 if final else held_suffix(text, fmt.markers)
        sent = text[: len(text) - keep]
        body = sent.rstrip()  # whitespace waits for what follows it
        if body:
            out.append(ContentDelta(body))
        self._pending = text[len(body) :]
        return False

    def _open_block(self, space: str, body: str, lead: str) -> None:
        """A call block opened at the start by `lead` (`<|python_tag|>` is consumed; `{` and
        `[` are the block's own first character)."""
        self._block_announced = self._in_array = False
        consumed = lead not in ("{", "[")
        self._raw = space + (lead if consumed else "")
        self._push_back("", body[len(lead) :] if consumed else body)
        if lead == "[" or self._format.after_marker == "array":
            self._mode, self._object = _Mode.ARRAY_OPEN, None
        else:
            self._mode, self._object = _Mode.OBJECT, _CallObject()

    def _keep(self, ch: str) -> None:
        # the block's text matters only until a call in it is announced
        if not self._block_announced:
            self._raw += ch

    def _char(self, ch: str, out: list[Delta]) -> None:
        mode = self._mode
        if mode is _Mode.SKIP:
            close = self._format.close
            self._raw = (self._raw + ch)[-len(close) :] if close else ""
            if close and self._raw == close:
                self._mode, self._raw = _Mode.OUTSIDE, ""
            return
        if mode is _Mode.ARRAY_OPEN:
            if ch.isspace() or ch == "[":
                self._keep(ch)
                if ch == "[":
                    self._in_array = True
                    self._mode, self._object = _Mode.OBJECT, _CallObject()
                return
            if ch != "{":
                self._give_back(out, ch)
                return
            self._mode, self._object = _Mode.OBJECT, _CallObject()
        if self._mode is _Mode.OBJECT:
            obj = self._object
            assert obj is not None
            consumed = obj.feed(ch)
            if consumed:
                self._keep(ch)
            self._announce(obj, out)
            if obj.failed:
                if self._block_announced:
                    # an announced call stays incomplete; one not announced breaks the block
                    self._cut = self._cut or obj.call is None
                    self._mode, self._raw = _Mode.SKIP, ""
                else:
                    self._give_back(out, "" if consumed else ch)
            elif obj.done:
                self._calls[-1].complete = True
                self._mode, self._raw = _Mode.AFTER, ""
                if not consumed:
                    self._push_back(ch)
            return
        self._after(ch)

    def _after(self, ch: str) -> None:
        """After a call's object: a separator, the block's close, or outside text again."""
        fmt = self._format
        if fmt.close:
            self._raw += ch
            seen = self._raw.lstrip()
            if fmt.close.startswith(seen):
                if seen == fmt.close:
                    self._mode, self._raw = _Mode.OUTSIDE, ""
                return
            self._mode, raw, self._raw = _Mode.OUTSIDE, self._raw, ""
            self._push_back(raw)
            return
        if ch.isspace():
            return
        if ch == ("," if self._in_array else ";") and fmt.after_marker != "object":
            self._mode, self._object = _Mode.OBJECT, _CallObject()
        elif ch == "]" and self._in_array:
            self._mode = _Mode.OUTSIDE
        else:
            self._mode = _Mode.OUTSIDE
            self._push_back(ch)

    def _announce(self, obj: _CallObject, out: list[Delta]) -> None:
        if obj.name is None or obj.failed:
            return
        if obj.call is None:
            obj.call = ToolCall(self.make_id(), obj.name, "")
            self._calls.append(_Announced(obj.call))
            self._block_announced = True
            out.append(CallDelta(len(self._calls) - 1, "", obj.call.id, obj.name))
        fragment = obj.take()
        if fragment:
            obj.call.arguments += fragment
            out.append(CallDelta(len(self._calls) - 1, fragment))

    def _give_back(self, out: list[Delta], rest: str) -> None:
        """The block is not a call: its text is content, and what follows is read again."""
        raw = self._raw
        self._raw, self._mode, self._object = "", _Mode.OUTSIDE, None
        self._at_start = False
        text = self._pending + raw
        body = text.rstrip()
        if body:
            out.append(ContentDelta(body))
        self._pending = text[len(body) :]
        self._push_back(rest)


def held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that may be the start of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


def _merged(deltas: list[Delta]) -> list[Delta]:
    """Adjacent pieces of the same kind joined: fewer, larger chunks."""
    out: list[Delta] = []
    for d in deltas:
        last = out[-1] if out else None
        if isinstance(d, ContentDelta) and isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + d.text)
        elif (
            isinstance(d, CallDelta)
            and isinstance(last, CallDelta)
            and d.id is None
            and last.index == d.index
            and last.arguments
        ):
            out[-1] = CallDelta(last.index, last.arguments + d.arguments, last.id, last.name)
        else:
            out.append(d)
    return out


class NamedCallStream:
    """`tool_choice` naming a function, decoding constrained to its arguments: the whole
    answer is that one call's arguments."""

    def __init__(self, name: str, make_id: Callable[[], str] = new_call_id) -> None:
        self.call = ToolCall(make_id(), name, "")
        self._announced = False
        self.broken = False

    @property
    def calls(self) -> list[ToolCall]:
        return [self.call]

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if not self._announced:
            self._announced = True
            out.append(CallDelta(0, "", self.call.id, self.call.name))
        if text:
            self.call.arguments += text
            out.append(CallDelta(0, text))
        return out

    def finish(self) -> list[Delta]:
        out = self.feed("")
        try:
            self.broken = not isinstance(json.loads(self.call.arguments), dict)
        except ValueError:
            self.broken = True
        return out


CallStream = ToolCallStream | NamedCallStream


def parse_calls(stream: CallStream, text: str) -> Parsed:
    """A whole answer through a fresh stream. A call that broke (a malformed or cut-off
    call) leaves the whole text as content with no calls, as vLLM answers; a named call is
    the answer whatever it holds (its decoding was constrained)."""
    deltas = [*stream.feed(text), *stream.finish()]
    calls = stream.calls
    if stream.broken and isinstance(stream, ToolCallStream):
        return Parsed(text, [])
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    if not calls:
        return Parsed(content, [])
    return Parsed(content or None, calls)


def tool_call_stream(
    parser: str, named: str | None = None, make_id: Callable[[], str] = new_call_id
) -> CallStream:
    """The stream for `parser` (hermes, llama3_json, mistral, or `required`), or for one
    `named` function's constrained arguments."""
    if named is not None:
        return NamedCallStream(named, make_id)
    if parser not in _FORMATS:
        raise ToolParserError(f"unknown tool call parser {parser!r}")
    return ToolCallStream(parser, make_id)
