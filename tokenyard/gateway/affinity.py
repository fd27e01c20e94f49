"""The gateway's half of prefix affinity: each job's prefix key (the broker's half, which
worker a job is held for and for how long, is in `broker/policy.py`).

A chat request's key covers its system prompt (the tokens it shares with the templated system
messages alone); those are tokenized once per distinct system prompt and model, and kept in a
small LRU, so the hot path adds no tokenization and no broker round trip.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from tokenyard.engines.base import EngineTokenizer

BLOCK = 16  # tokens per prefix-cache block (vLLM's default block size)


def prefix_key(token_ids: Sequence[int] | None, prefix_tokens: int, block: int = BLOCK) -> str:
    """Hash of the prompt's first whole blocks, at most `prefix_tokens` tokens; '' for none.

    Only whole blocks count because engines cache whole blocks; a prompt shorter than one
    block, or `prefix_tokens` < `block` (affinity off), has no key. The token count is hashed
    too, so keys of different lengths never collide by construction.
    """
    if not token_ids or prefix_tokens < block or block <= 0:
        return ""
    n = min(prefix_tokens, len(token_ids)) // block * block
    if n == 0:
        return ""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(n.to_bytes(4, "little"))
    # one C-level copy: this runs on the gateway's event loop for every request
    digest.update(array("q", token_ids[:n]).tobytes())
    return digest.hexdigest()


def shared_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_limit(
    token_ids: Sequence[int], system_ids: Sequence[int] | None, prefix_tokens: int
) -> int:
    """How many leading tokens the prefix key covers: the part shared with the templated
    system prompt alone (`system_ids`, a chat request's system messages) when there is one,
    so the user's turn never splits one system prompt into many keys; else `prefix_tokens`."""
    if system_ids:
        return min(prefix_tokens, shared_len(token_ids, system_ids))
    return prefix_tokens


_SYSTEM = frozenset({"system"})


class PrefixKeys:
    """Prefix keys for jobs; `prefix_tokens` 0 turns affinity off at the gateway."""

    def __init__(self, prefix_tokens: int, block: int = BLOCK, entries: int = 256) -> None:
        self.prefix_tokens = prefix_tokens
        self.block = block
        self._entries = entries
        self._system: OrderedDict[tuple[str, tuple[str, ...]], list[int]] = OrderedDict()

    def key(
        self,
        model: str,
        tokenizer: EngineTokenizer,
        token_ids: Sequence[int],
        messages: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        if self.prefix_tokens < self.block:
            return ""
        system_ids = self._system_ids(model, tokenizer, messages) if messages else None
        limit = prefix_limit(token_ids, system_ids, self.prefix_tokens)
        return prefix_key(token_ids, limit, self.block)

    def _system_ids(
        self, model: str, tokenizer: EngineTokenizer, messages: Sequence[Mapping[str, Any]]
    ) -> list[int] | None:
        lead: list[Mapping[str, Any]] = []
        for message in messages:  # the leading system messages
            if message["role"] not in _SYSTEM:
                break
            lead.append(message)
        if not lead:
            return None
        cache_key = (model, tuple(m["content"] for m in lead))
        ids = self._system.get(cache_key)
        if ids is None:
            try:
                ids = tokenizer.encode(tokenizer.apply_chat_template(lead))
            except Exception:  # a template may refuse a system-only conversation
                ids = []
            self._system[cache_key] = ids
            if len(self._system) > self._entries:
                self._system.popitem(last=False)
        else:
            self._system.move_to_end(cache_key)
        return ids or None
