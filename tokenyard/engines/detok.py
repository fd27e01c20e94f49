"""Pure text helpers for engines: incremental detokenization, stop strings, per-sequence limits."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import cast

import msgspec

from tokenyard.messages import FinishReason, SamplingParams

Decode = Callable[[Sequence[int]], str]

REPLACEMENT = "\ufffd"
# Prompt tokens kept as decode context so tokenizers that drop a leading space on the first
# token of a decode call (SentencePiece) still produce the right text for the first token.
_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never end in a broken character.

    Text is decoded over a small window (`prefix` .. end) and diffed against the window's
    already-emitted part, so the cost per token is constant and tokenizers whose decode
    depends on neighbours still produce the same text as a full decode. A trailing run of
    U+FFFD (bytes of a character still being generated) is held back until it resolves.
    """

    def __init__(
        self,
        decode: Decode,
        prompt_ids: Sequence[int] = (),
        resume_ids: Sequence[int] = (),
    ) -> None:
        self._decode = decode
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._ids = [*context, *resume_ids]
        self._prefix = 0
        self._read = len(context)  # tokens before this are fully emitted
        self._partial = ""  # text after `_read` already emitted (whole characters only)
        # An earlier attempt emitted its tokens' text except a trailing incomplete character
        # (a fresh sequence has none: its two decode calls are skipped)
        self.resumed_text = self._unread_text().rstrip(REPLACEMENT) if resume_ids else ""
        self._partial = self.resumed_text

    def _unread_text(self) -> str:
        base = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        return text[len(base) :] if len(text) > len(base) else ""

    def _mark_emitted(self) -> None:
        self._read = len(self._ids)
        self._prefix = max(0, self._read - _CONTEXT_TOKENS)
        self._partial = ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return newly completed text (possibly empty)."""
        self._ids.extend(token_ids)
        text = self._unread_text()
        if not text.endswith(REPLACEMENT):
            out = text[len(self._partial) :]
            self._mark_emitted()
            return out
        # Emit the whole characters before the incomplete tail; earlier text never changes.
        safe = text.rstrip(REPLACEMENT)
        if len(safe) <= len(self._partial):
            return ""
        out, self._partial = safe[len(self._partial) :], safe
        return out

    def flush(self) -> str:
        """Return whatever is held back (at the end of a sequence), replacement chars included."""
        out = self._unread_text()[len(self._partial) :]
        self._mark_emitted()
        return out


class StopMatcher:
    """Finds stop strings in streamed text, holding back any tail that could start one;
    `include`: a stop string found ends the text (vLLM's `include_stop_str_in_output`)."""

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""

    @property
    def held(self) -> str:
        return self._held

    @property
    def active(self) -> bool:
        """Whether there is any stop string to look for."""
        return bool(self._stops)

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string matched); a stop is never emitted."""
        if not self._stops:
            return text, False
        buf = self._held + text
        # Any occurrence lies inside `buf`: a stop starting in already-emitted text would have
        # made that text a held prefix instead.
        hits = [(i, i + len(s)) for i, s in ((buf.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            start, end = min(hits)
            return buf[: end if self._include else start], True
        keep = 0
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                keep = k
                break
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """Release the held tail (the sequence ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held


class Delta(msgspec.Struct):
    """What one engine step adds to a sequence after limits, EOS and stop strings are applied."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None


class SequenceDecoder:
    """Applies SamplingParams to one sequence's token stream: text, EOS, stop token ids, stop
    strings, max_tokens.

    `limit` is the total completion budget (resumed tokens included); engines pass
    min(max_tokens, context length - prompt length). EOS and `stop_token_ids` end a sequence
    with STOP (kept in its token ids, not in its text) once it has `min_tokens` tokens, as
    vLLM's stop check; ignore_eos leaves the stop token ids in force. vLLM's detokenization
    switches: `include_stop_str_in_output` keeps the stop string, or the ending token's text
    (a special token's only with `skip_special_tokens` false), in the text; the other two are
    the tokenizer's (`decode` takes them as keywords when they are not the defaults).
    """

    def __init__(
        self,
        decode: Decode,
        params: SamplingParams,
        *,
        prompt_ids: Sequence[int],
        eos_token_ids: Collection[int] = (),
        resume_ids: Sequence[int] = (),
        limit: int | None = None,
    ) -> None:
        self.params = params
        self.limit = params.max_tokens if limit is None else min(limit, params.max_tokens)
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._eos = eos | frozenset(params.stop_token_ids)
        if not (params.skip_special_tokens and params.spaces_between_special_tokens):
            decode = functools.partial(
                cast(Callable[..., str], decode),
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
            )
        self._include_stop = params.include_stop_str_in_output
        self._detok = IncrementalDetokenizer(decode, prompt_ids, resume_ids)
        self._stops = StopMatcher(params.stop, include=self._include_stop)
        self.completion_tokens = len(resume_ids)
        self.finish_reason: FinishReason | None = None
        if resume_ids:
            self._replay_resume(resume_ids)
        if self.finish_reason is None and self.completion_tokens >= self.limit:
            self.finish_reason = FinishReason.LENGTH

    def _ends(self, token_id: int) -> bool:
        """Whether a token just counted in `completion_tokens` ends the sequence."""
        return token_id in self._eos and self.completion_tokens >= self.params.min_tokens

    def _replay_resume(self, resume_ids: Sequence[int]) -> None:
        if self._ends(resume_ids[-1]):
            self.finish_reason = FinishReason.STOP
            return
        # Rebuild the stop matcher's held tail, which the earlier attempt had not emitted.
        _, stopped = self._stops.feed(self._detok.resumed_text)
        if stopped:
            self.finish_reason = FinishReason.STOP

    @property
    def remaining(self) -> int:
        """Tokens still allowed before LENGTH."""
        return max(0, self.limit - self.completion_tokens)

    def feed(self, token_ids: Sequence[int]) -> Delta:
        """Consume newly generated tokens; tokens after a finish are dropped."""
        if self.finish_reason is not None:
            return Delta([], "", self.finish_reason)
        taken: list[int] = []
        pieces: list[str] = []
        # Without stop strings no token's own text decides where the sequence ends, so a run
        # of tokens that ends nothing is decoded in one push (two decode calls, not two per
        # token: an upstream's read of several tokens, a step of many); with them, each token's
        # text is matched as it comes, so a stop ends the tokens taken where it completes.
        run: list[int] | None = [] if not self._stops.active else None
        for tok in token_ids:
            taken.append(tok)
            self.completion_tokens += 1
            ends = self._ends(tok)
            if run is not None and not ends:
                run.append(tok)  # its text comes with the run's
                if self.completion_tokens < self.limit:
                    continue
            if run:
                pieces.append(self._detok.push(run))
                run = []
            if ends:
                stopped = False
                if self._include_stop:  # its text ends the output
                    out, stopped = self._stops.feed(self._detok.push([tok]))
                    pieces.append(out)
                if not stopped:
                    pieces.append(self._close_text())
                self.finish_reason = FinishReason.STOP
                break
            if run is None:  # stop strings: each token's text matched as it comes
                out, stopped = self._stops.feed(self._detok.push([tok]))
                pieces.append(out)
                if stopped:
                    self.finish_reason = FinishReason.STOP
                    break
            if self.completion_tokens >= self.limit:
                pieces.append(self._close_text())
                # The flushed tail can itself complete a stop string.
                self.finish_reason = self.finish_reason or FinishReason.LENGTH
                break
        if run:
            pieces.append(self._detok.push(run))
        return Delta(taken, "".join(pieces), self.finish_reason)

    def _close_text(self) -> str:
        out, stopped = self._stops.feed(self._detok.flush())
        if stopped:
            self.finish_reason = FinishReason.STOP
            return out
        return out + self._stops.flush()

    def close(self, reason: FinishReason) -> Delta:
        """End the sequence for an engine-side reason, releasing held-back text."""
        if self.finish_reason is not None:
            return Delta([], "", self.finish_reason)
        text = self._close_text()
        self.finish_reason = self.finish_reason or reason
        return Delta([], text, self.finish_reason)
