"""Structured outputs: a `Guide` compiled by xgrammar for one tokenizer, and the matcher that
constrains one sequence to it.

Compiling runs on a small pool with a deadline, so a pathological schema fails the attempt
(retryably: it goes on compiling for the retry) instead of stalling the caller; the compiler
caches grammars, and `GuideCompiler` remembers each guide's compilation (its failure too), so a
schema compiles once per engine.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from tokenyard.errors import EngineError, InvalidRequest
from tokenyard.messages import Guide

COMPILE_TIMEOUT_S = 10.0
_PARAM = "response_format"
_REMEMBERED = 256  # compilations kept per engine (xgrammar's own cache holds the grammars too)
# xgrammar (0.2.8) writes a JSON string's characters as these classes: a length-bounded one
# lets raw control characters through (invalid JSON: json.loads refuses them), and both let the
# 3-byte UTF-8 forms of surrogates through (ED A0..BF xx: not UTF-8, decoded as three U+FFFD, so
# a maxLength counted one character is three). Strict JSON text excludes both.
_LAX_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\\r\n\uD800-\uDFFF]"
_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar (xgrammar's dialect) matching exactly one of `choices`.

    JSON string escaping is what xgrammar's EBNF literals accept, so any text is matched
    literally (regex escaping would depend on the regex dialect).
    """
    if not choices:
        raise InvalidRequest("choice needs at least one alternative", param=_PARAM)
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices))
    return f"root ::= {alternatives}"


def json_schema_grammar(schema: str) -> str:
    """The EBNF grammar of a JSON schema: compact JSON (any_whitespace would let a sampled
    model pad with spaces and newlines forever; vLLM turns it off for xgrammar too), strict
    (no properties beyond the schema's), strings of valid characters (see above)."""
    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
    for lax in _LAX_STRING_CHARS:
        grammar = grammar.replace(lax, _JSON_STRING_CHAR)
    return grammar


def guide_kind(guide: Guide) -> str:
    """Which one of the guide's fields is set; InvalidRequest unless exactly one is."""
    return guide.field[0]


@dataclass
class _Compilation:
    """One guide's compilation, and until when its waiters wait for it (monotonic)."""

    future: Future[xgr.CompiledGrammar]
    deadline: float


class GuideCompiler:
    """Compiles guides for one tokenizer and vocabulary (the model's logits width)."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        vocab_size: int,
        stop_token_ids: Collection[int],
        timeout: float = COMPILE_TIMEOUT_S,
        workers: int = 2,
    ) -> None:
        self.vocab_size = vocab_size
        self.timeout = timeout
        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=workers, cache_enabled=True)
        # Threads that outlive a timed-out compilation keep working; the next request for the
        # same guide waits on that same compilation instead of starting another.
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenyard-guide")
        self._lock = threading.Lock()
        self._compilations: OrderedDict[Guide, _Compilation] = OrderedDict()

    def _compile_now(self, guide: Guide, kind: str) -> xgr.CompiledGrammar:
        c = self._compiler
        _, value = guide.field
        if kind == "json":
            try:
                json.loads(value)
            except ValueError as exc:
                raise InvalidRequest(f"the JSON schema is not JSON: {exc}", param=_PARAM) from exc
            return c.compile_grammar(json_schema_grammar(value))
        if kind == "json_object":
            # OpenAI's json_object is an object; xgrammar's builtin JSON grammar allows any value
            return c.compile_grammar(json_schema_grammar(_ANY_OBJECT))
        if kind == "regex":
            return c.compile_regex(value)
        if kind == "choice":
            return c.compile_grammar(choice_grammar(value))
        return c.compile_grammar(value)

    def compile(self, guide: Guide, *, fresh_window: bool = False) -> xgr.CompiledGrammar:
        """The guide's grammar. InvalidRequest when it does not compile; EngineError (the
        attempt fails and is retried, the compilation goes on) when it is not done within
        `timeout` of when it began.

        Waits at most until the compilation's deadline, so a caller after one that already
        waited it out (the worker's `Engine.ready_for`, then `add`) does not wait again;
        `fresh_window` (for a caller off the event loop) gives a compilation still running
        past its deadline another `timeout`, as a retried job's first wait.
        """
        kind = guide_kind(guide)
        now = time.monotonic()
        with self._lock:
            compilation = self._compilations.get(guide)
            if compilation is None:
                future = self._pool.submit(self._compile_now, guide, kind)
                compilation = _Compilation(future, now + self.timeout)
                self._compilations[guide] = compilation
                while len(self._compilations) > _REMEMBERED:
                    self._compilations.popitem(last=False)
            else:
                self._compilations.move_to_end(guide)
                if fresh_window and compilation.deadline <= now:
                    compilation.deadline = now + self.timeout
            future, deadline = compilation.future, compilation.deadline
        try:
            return future.result(timeout=max(0.0, deadline - now))
        except FutureTimeout:
            raise EngineError(
                f"the {kind} structured output did not compile within {self.timeout:g} s "
                f"(it goes on compiling, for a retry)"
            ) from None
        except InvalidRequest:
            raise
        except Exception as exc:  # xgrammar's errors: RuntimeError, ValueError, its own types
            raise InvalidRequest(
                f"the {kind} structured output is not supported: {exc}", param=_PARAM
            ) from exc

    def matcher(self, guide: Guide, resume_ids: Sequence[int] = ()) -> GuideMatcher:
        """A matcher for one sequence, past the tokens an earlier attempt generated."""
        return GuideMatcher(self.compile(guide), self.vocab_size, resume_ids)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GuideMatcher:
    """Follows one constrained sequence: which tokens may come next, and whether it is done."""

    def __init__(
        self, grammar: xgr.CompiledGrammar, vocab_size: int, resume_ids: Sequence[int] = ()
    ) -> None:
        self._matcher = xgr.GrammarMatcher(grammar)
        self.vocab_size = vocab_size
        for tok in resume_ids:
            if not self._matcher.accept_token(tok):
                raise InvalidRequest(
                    "the resumed tokens do not follow the structured output", param=_PARAM
                )

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; False when the grammar does not allow it."""
        return bool(self._matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        """The grammar ended (its stop token accepted): the sequence is complete."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (xgrammar's packed int32 layout)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A host bitmask for `rows` sequences: one bit per token, packed in int32 words."""
    return xgr.allocate_token_bitmask(rows, vocab_size)
