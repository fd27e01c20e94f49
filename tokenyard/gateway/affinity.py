"""The gateway's half of prefix affinity: each job's prefix key (see tokenyard/affinity.py).

A chat request's key covers its system prompt (the tokens it shares with the templated system
messages alone); those are tokenized once per distinct system prompt and model, and kept in a
small LRU, so the hot path adds no tokenization and no broker round trip.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tokenyard.affinity import BLOCK, prefix_key, prefix_limit
from tokenyard.engines.base import EngineTokenizer

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
        messages: Sequence[dict[str, str]] | None = None,
    ) -> str:
        if self.prefix_tokens < self.block:
            return ""
        system_ids = self._system_ids(model, tokenizer, messages) if messages else None
        limit = prefix_limit(token_ids, system_ids, self.prefix_tokens)
        return prefix_key(token_ids, limit, self.block)

    def _system_ids(
        self, model: str, tokenizer: EngineTokenizer, messages: Sequence[dict[str, str]]
    ) -> list[int] | None:
        lead: list[dict[str, str]] = []
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
