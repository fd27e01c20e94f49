"""What each request asks: prompt and output lengths drawn from seeded distributions."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Common English words that are one token (with their leading space) in the GPT-2, Llama and
# Qwen vocabularies, so a prompt of N words is close to N tokens without a tokenizer here.
_WORD_LIST = """the of and to in is was for on that with as by at from his her it an are were which
    this be or have had not but one all they their there been has more when who will would
    no if out so up said what its about into than them can only other new some could time
    these two may first then do any like my now over such our man me even most made after
    also did many before must through back years where much your way well down should
    because each just those people how too little state good very make world still own see
    men work long get here between both life being under never day same another know while
    last might us great old year off come since against go came right used take three
    house water city land light line music book game story field power word school night
    point group money river table paper friend street window garden morning summer ocean
"""
WORDS: tuple[str, ...] = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class LengthDist:
    """A token count: fixed (`low == high`) or uniform over `[low, high]`, both inclusive."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"a length range needs 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        """`128` (fixed) or `64:256` (uniform, inclusive)."""
        text = spec.strip()
        try:
            if ":" in text:
                low, high = text.split(":", 1)
                return cls(int(low), int(high))
            return cls(int(text), int(text))
        except ValueError as exc:
            raise ValueError(
                f"length must be N or LOW:HIGH (positive integers), got {spec!r}: {exc}"
            ) from None

    def sample(self, rng: random.Random) -> int:
        """One length; a fixed distribution consumes no randomness."""
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def describe(self) -> str:
        return str(self.low) if self.low == self.high else f"uniform[{self.low},{self.high}]"


@dataclass(frozen=True)
class PromptItem:
    """One prompt from a file: text or chat messages, and optionally its own output length."""

    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    max_tokens: int | None = None

    def text(self) -> str:
        """The prompt as plain text (chat messages joined by newlines for /v1/completions)."""
        if self.prompt is not None:
            return self.prompt
        return "\n".join(_content_text(m.get("content")) for m in self.messages or ())


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def parse_prompt_line(line: str, where: str = "line") -> PromptItem:
    """A JSONL line: a JSON string, or an object with `prompt` or `messages`, and optionally
    `max_tokens` (or `output_len`)."""
    value = json.loads(line)
    if isinstance(value, str):
        return PromptItem(prompt=value)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a string or an object, got {type(value).__name__}")
    out = value.get("max_tokens", value.get("output_len"))
    if out is not None and (not isinstance(out, int) or out < 1):
        raise ValueError(f"{where}: max_tokens must be a positive integer, got {out!r}")
    if isinstance(value.get("prompt"), str):
        return PromptItem(prompt=value["prompt"], max_tokens=out)
    messages = value.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return PromptItem(messages=tuple(messages), max_tokens=out)
    raise ValueError(f"{where}: needs a string 'prompt' or a non-empty 'messages' list")


def load_prompts(path: Path) -> tuple[PromptItem, ...]:
    """Every prompt of a JSONL file; blank lines are skipped, a bad line fails with its number."""
    items: list[PromptItem] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                items.append(parse_prompt_line(line, f"{path}:{number}"))
    if not items:
        raise ValueError(f"{path}: no prompts")
    return tuple(items)


@dataclass(frozen=True)
class RequestSpec:
    """One request to send: its index in the run, its prompt and its output length."""

    index: int
    prompt: str
    messages: tuple[dict[str, Any], ...] | None
    max_tokens: int
    prompt_words: int

    def chat_messages(self) -> list[dict[str, Any]]:
        """Messages for /v1/chat/completions: the file's own, or the prompt as one user turn."""
        if self.messages is not None:
            return [dict(m) for m in self.messages]
        return [{"role": "user", "content": self.prompt}]


def synthetic_prompt(words: int, rng: random.Random, vocabulary: Sequence[str] = WORDS) -> str:
    """`words` random common words: about as many tokens, and unlikely to repeat a prefix."""
    return " ".join(rng.choices(vocabulary, k=words))


@dataclass(frozen=True)
class Workload:
    """Prompt and output length distributions, or prompts from a file; seeded, reproducible."""

    prompt_len: LengthDist
    output_len: LengthDist
    prompts: tuple[PromptItem, ...] = ()
    # a per-request tag in front of every prompt defeats response caches and request collapsing
    cache_bust: str | None = None

    def requests(self, seed: int | str) -> Iterator[RequestSpec]:
        """Endless request specs; the same seed gives the same sequence."""
        rng = random.Random(f"tokenyard-bench:workload:{seed}")
        index = 0
        while True:
            yield self._one(index, rng)
            index += 1

    def _one(self, index: int, rng: random.Random) -> RequestSpec:
        messages: tuple[dict[str, Any], ...] | None = None
        if self.prompts:
            item = self.prompts[rng.randrange(len(self.prompts))]
            prompt, messages = item.text(), item.messages
            max_tokens = item.max_tokens or self.output_len.sample(rng)
        else:
            prompt = synthetic_prompt(self.prompt_len.sample(rng), rng)
            max_tokens = self.output_len.sample(rng)
        if self.cache_bust is not None:
            tag = f"[{self.cache_bust}-{index}] "
            prompt = tag + prompt
            if messages is not None:
                messages = _tag_last_user(messages, tag)
        return RequestSpec(index, prompt, messages, max_tokens, len(prompt.split()))

    def describe(self) -> dict[str, Any]:
        """The workload's settings for the report."""
        out: dict[str, Any] = {"output_len": self.output_len.describe()}
        if self.prompts:
            out["prompts_from_file"] = len(self.prompts)
        else:
            out["prompt_len"] = self.prompt_len.describe()
        out["cache_bust"] = self.cache_bust is not None
        return out


def _tag_last_user(messages: tuple[dict[str, Any], ...], tag: str) -> tuple[dict[str, Any], ...]:
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            message["content"] = tag + message["content"]
            break
    else:
        out.insert(0, {"role": "system", "content": tag})
    return tuple(out)
