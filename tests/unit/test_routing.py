"""Routing rules: aliases and the fast path with its congestion fallback (pure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenyard.errors import FatalError
from tokenyard.gateway.routing import FastPath, RoutingRules, Rule, route

RULES = RoutingRules(
    aliases={"gpt-4o-mini": "big", "fast": "small"},
    fast_path=FastPath(model="small", below_tokens=100, from_models=("big",), max_depth=8),
)


def test_aliases_name_served_models() -> None:
    assert route(RULES, "gpt-4o-mini", 500) == ("big", Rule.ALIAS)
    assert route(RULES, "fast", 500) == ("small", Rule.ALIAS)
    assert route(RULES, "big", 500) == ("big", Rule.REQUESTED)


def test_short_prompts_take_the_fast_path_unless_it_is_congested() -> None:
    assert route(RULES, "big", 99, fast_depth=0) == ("small", Rule.FAST)
    assert route(RULES, "gpt-4o-mini", 10, fast_depth=8) == ("small", Rule.FAST)
    assert route(RULES, "big", 10, fast_depth=9) == ("big", Rule.CONGESTED)
    assert route(RULES, "big", 100, fast_depth=0) == ("big", Rule.REQUESTED)  # not under N
    assert route(RULES, "big", 10) == ("small", Rule.FAST)  # depth not read: not congested


def test_the_fast_path_applies_only_to_the_models_it_names() -> None:
    assert route(RULES, "other", 10, fast_depth=0) == ("other", Rule.REQUESTED)
    every = RoutingRules(fast_path=FastPath(model="small", below_tokens=100))
    assert route(every, "other", 10) == ("small", Rule.FAST)
    assert route(every, "small", 10) == ("small", Rule.REQUESTED)


def test_no_depth_limit_never_falls_back() -> None:
    unlimited = RoutingRules(fast_path=FastPath(model="small", below_tokens=100))
    assert route(unlimited, "big", 10, fast_depth=10_000) == ("small", Rule.FAST)


def test_rules_load_from_a_file_and_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "routing.json"
    path.write_text(
        json.dumps({"aliases": {"a": "big"}, "fast_path": {"model": "small", "below_tokens": 5}})
    )
    rules = RoutingRules.from_file(str(path), ["big", "small"])
    assert rules.aliases == {"a": "big"} and rules.fast_path is not None
    with pytest.raises(FatalError, match="does not serve"):
        RoutingRules.from_file(str(path), ["big"])
    path.write_text(json.dumps({"aliases": {"big": "small"}}))
    with pytest.raises(FatalError, match="shadow"):
        RoutingRules.from_file(str(path), ["big", "small"])
    path.write_text(json.dumps({"alias": {}}))
    with pytest.raises(FatalError, match="invalid routing file"):
        RoutingRules.from_file(str(path), ["big"])
    assert RoutingRules.from_file("", ["big"]) == RoutingRules()
