"""Prefix affinity (issue 11 item 4): the pure parts.

A job's *prefix key* names the first whole blocks of its prompt (up to `prefix_tokens`
tokens, e.g. a shared system prompt). The broker remembers which worker last claimed a prefix;
a new job with that prefix is held for that worker, whose engine likely still has the prefix's
KV cache, for at most `affinity_wait_s`; after that any worker takes it. The broker's side
is `enqueue.lua` / `claim.lua` and `MemoryBroker`; these functions are the rules they share.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

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


def hold_for(owner: str | None, held: int, max_held: int) -> bool:
    """Whether a new job is held for the prefix's `owner`: it has one, and fewer than
    `max_held` jobs already wait for it (a hot prefix must not pile up on one worker)."""
    return bool(owner) and held < max_held


def overdue(held_at: float, now: float, wait_s: float) -> bool:
    """A held job any worker may take: it waited `wait_s` for its preferred worker."""
    return now - held_at >= wait_s
