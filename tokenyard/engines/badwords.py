"""vLLM's `bad_words`, as every engine that masks them here reads them (no torch needed)."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def bad_words_token_ids(
    words: Sequence[str], encode: Callable[[str], list[int]]
) -> list[tuple[int, ...]]:
    """vLLM's token sequences of `bad_words` (`encode`: text to ids, no special tokens added):
    each word as written at the start of a text, and with a space before it where that makes
    other tokens of the same count (a word in the middle of a text)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(encode(word.lstrip()))
        out.append(bare)
        spaced = tuple(encode(" " + word.lstrip()))
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return [ids for ids in out if ids]


def banned_tokens(bad_words: Sequence[tuple[int, ...]], output: Sequence[int]) -> set[int]:
    """The tokens bad words ban next: each one's last token, where the output ends with the
    rest of it (a one-token word: always), as vLLM matches them against the output."""
    banned = set()
    for ids in bad_words:
        prefix = len(ids) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or tuple(output[-prefix:]) == ids[:-1]:
            banned.add(ids[-1])
    return banned
