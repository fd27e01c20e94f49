"""Routing rules from config: model aliases, and a fast path that sends short prompts to a small
model unless its lanes are congested. `route` is pure; the gateway feeds it the prompt's length
and the small model's depth (`LaneDepths`, read at most every `ttl_s`)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import msgspec

from tokenyard.broker.core import Stats
from tokenyard.errors import FatalError


class FastPath(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prompts under `below_tokens` asked of a model in `from_models` go to `model`, unless
    `model` has more than `max_depth` jobs waiting or running (0: no limit)."""

    model: str
    below_tokens: int
    from_models: tuple[str, ...] = ()  # empty: every other model
    max_depth: int = 0


class RoutingRules(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The gateway's `routing_file`: {"aliases": {...}, "fast_path": {...}}."""

    aliases: dict[str, str] = msgspec.field(default_factory=dict)
    fast_path: FastPath | None = None

    @classmethod
    def from_file(cls, path: str, served: Collection[str]) -> RoutingRules:
        """Load and check the rules against the served models; fail fast when invalid."""
        if not path:
            return cls()
        try:
            rules = msgspec.json.decode(Path(path).read_bytes(), type=cls)
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise FatalError(f"invalid routing file {path}: {exc}") from exc
        rules.check(served)
        return rules

    def check(self, served: Collection[str]) -> None:
        targets = set(self.aliases.values())
        if self.fast_path is not None:
            targets |= {self.fast_path.model, *self.fast_path.from_models}
        unknown = sorted(targets - set(served))
        if unknown:
            raise FatalError(f"routing names models this gateway does not serve: {unknown}")
        clash = sorted(set(self.aliases) & set(served))
        if clash:
            raise FatalError(f"routing aliases shadow served models: {clash}")

    def with_served_names(self, aliases: Mapping[str, str]) -> RoutingRules:
        """These rules with a model's other served names as aliases of it."""
        clash = sorted(set(aliases) & set(self.aliases))
        if clash:
            raise FatalError(f"routing aliases are served model names too: {clash}")
        return msgspec.structs.replace(self, aliases={**self.aliases, **aliases})


class Rule(enum.StrEnum):
    """Why a request runs on the model it does (the `rule` label of the routing metric)."""

    REQUESTED = "requested"
    ALIAS = "alias"
    ADAPTER = "adapter"  # a LoRA adapter's name: its base model runs with it
    FAST = "fast"
    CONGESTED = "congested"  # short enough for the fast path, but its model was congested


def resolve_alias(rules: RoutingRules, model: str) -> str:
    return rules.aliases.get(model, model)


def wants_fast_path(rules: RoutingRules, model: str, prompt_tokens: int) -> bool:
    """Whether the fast path applies, before its model's congestion is known."""
    fast = rules.fast_path
    if fast is None or model == fast.model or prompt_tokens >= fast.below_tokens:
        return False
    return not fast.from_models or model in fast.from_models


def route(
    rules: RoutingRules,
    requested: str,
    prompt_tokens: int,
    fast_depth: int | None = None,
) -> tuple[str, Rule]:
    """The model a request runs on, and the rule that chose it. `fast_depth` is the fast
    model's jobs waiting or running (None: not read, counts as not congested)."""
    model = resolve_alias(rules, requested)
    rule = Rule.ALIAS if model != requested else Rule.REQUESTED
    fast = rules.fast_path
    if fast is None or not wants_fast_path(rules, model, prompt_tokens):
        return model, rule
    if fast.max_depth and fast_depth is not None and fast_depth > fast.max_depth:
        return model, Rule.CONGESTED
    return fast.model, Rule.FAST


class LaneDepths:
    """Each model's depth (jobs waiting or running), read at most every `ttl_s`."""

    def __init__(
        self, stats: Stats, ttl_s: float = 0.25, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.stats = stats
        self.ttl_s = ttl_s
        self.clock = clock
        self._known: dict[str, tuple[float, int]] = {}
        self._reading: dict[str, asyncio.Future[int]] = {}

    async def of(self, model: str) -> int:
        known = self._known.get(model)
        if known is not None and self.clock() - known[0] < self.ttl_s:
            return known[1]
        reading = self._reading.get(model)  # one read however many requests need it
        if reading is None:
            reading = asyncio.ensure_future(self._read(model))
            self._reading[model] = reading
            reading.add_done_callback(lambda _: self._reading.pop(model, None))
        return await asyncio.shield(reading)

    async def _read(self, model: str) -> int:
        depth = await self.stats.depth(model)
        self._known[model] = (self.clock(), depth)
        return depth
