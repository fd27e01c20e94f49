"""The checks every JSON body passes before a parser sees it: UTF-8, and a nesting bound.

JSON parsers recurse per level, and each reports a deep body its own way (an error naming its
internal limit, a RecursionError, a 500); a bound checked here first answers every route alike.
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate

from tokenyard.errors import InvalidRequest

# OpenAI's request bodies nest a handful of levels (chat content parts, metadata, tool schemas)
MAX_JSON_DEPTH = 64

_BRACKETS = b"[{]}"
_NOT_MARKS = bytes(b for b in range(256) if b not in b'"[{]}')
_NOT_OPENING = bytes(b for b in range(256) if b not in b"[{")
_STRING = re.compile(rb'"[^"]*"')  # once escapes are gone, and all but quotes and brackets
# an opening bracket steps one level in, a closing one out (0xff is -1 as a signed byte)
_STEPS = bytes.maketrans(_BRACKETS, b"\x01\x01\xff\xff")


def json_depth(raw: bytes) -> int:
    """How deep `raw` nests arrays and objects, brackets inside strings not counted.

    Every step runs in C: a Python loop over a megabyte would cost ~50 ms, this ~20 ms at most
    (a body of many short strings), less than parsing it. A body that is not JSON may count
    more than a parser would reach, never less."""
    if b"\\" in raw:
        # without escaped backslashes, a quote after a backslash is inside a string; without
        # those, the quotes left pair up around strings
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = _STRING.sub(b"", raw.translate(None, _NOT_MARKS))
    # a quote left over opened a string never closed: a parser reads no further than it
    steps = array("b", outside.translate(_STEPS, b'"'))
    return max(accumulate(steps), default=0)


def check_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    """400 for a body that is not UTF-8 or nests deeper than `max_depth`."""
    if not raw.isascii():
        try:
            raw.decode()
        except UnicodeDecodeError as exc:
            raise InvalidRequest(
                f"The request body is not valid UTF-8 (at byte {exc.start}): {exc.reason}",
                code="invalid_json",
            ) from None
    # most bodies open fewer brackets than the bound allows: no scan needed
    if len(raw.translate(None, _NOT_OPENING)) <= max_depth:
        return
    depth = json_depth(raw)
    if depth > max_depth:
        raise InvalidRequest(
            f"The request body nests arrays and objects {depth} levels deep; "
            f"at most {max_depth} are allowed",
            code="json_too_deep",
        )
