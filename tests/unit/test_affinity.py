"""Prefix affinity's pure parts: prefix keys, the hold rule, the sim engine's prefix cache."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenyard.broker.policy import hold_for, overdue
from tokenyard.engines.sim import PrefixCache, SimTokenizer
from tokenyard.gateway.affinity import PrefixKeys, prefix_key, prefix_limit, shared_len

SYSTEM = "You are the yard's dispatcher. Answer in one short sentence about the trains. " * 3


def test_prefix_key_covers_whole_blocks_only() -> None:
    ids = list(range(100))
    assert prefix_key(ids, 64, block=16) == prefix_key(ids[:64] + [7] * 36, 64, block=16)
    # 40 tokens allowed: two whole blocks (32); token 33 onwards does not count
    assert prefix_key(ids, 40, block=16) == prefix_key(ids[:32] + [1] * 50, 40, block=16)
    assert prefix_key(ids, 40, block=16) != prefix_key([9, *ids[1:]], 40, block=16)
    assert prefix_key(ids[:15], 64, block=16) == ""  # shorter than one block
    assert prefix_key(ids, 0) == "" and prefix_key(None, 64) == ""
    # the covered length is part of the key
    assert prefix_key(ids, 32, block=16) != prefix_key(ids, 48, block=16)


@given(st.lists(st.integers(0, 50), max_size=40), st.lists(st.integers(0, 50), max_size=40))
def test_shared_len_is_the_longest_common_prefix(a: list[int], b: list[int]) -> None:
    n = shared_len(a, b)
    assert a[:n] == b[:n]
    assert n == min(len(a), len(b)) or a[n] != b[n]


def test_prefix_limit_stops_at_the_system_prompt() -> None:
    assert prefix_limit([1, 2, 3, 4], [1, 2, 9], 100) == 2
    assert prefix_limit([1, 2, 3, 4], [1, 2, 3, 4, 5], 3) == 3
    assert prefix_limit([1, 2, 3], None, 100) == 100


def test_hold_rule() -> None:
    assert hold_for("w1", held=0, max_held=8)
    assert not hold_for("w1", held=8, max_held=8)
    assert not hold_for(None, held=0, max_held=8)
    assert not overdue(held_at=10.0, now=10.05, wait_s=0.1)
    assert overdue(held_at=10.0, now=10.25, wait_s=0.25)


def test_gateway_key_is_the_system_prompt_whatever_the_user_asks() -> None:
    tok = SimTokenizer()
    keys = PrefixKeys(prefix_tokens=1024)

    def key(system: str | None, user: str) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user}
        ]
        ids = tok.encode(tok.apply_chat_template(messages))
        return keys.key("m", tok, ids, messages)

    a = key(SYSTEM, "Where is car 7?")
    assert a and a == key(SYSTEM, "And car 12, going north with a long question attached?")
    assert a != key(SYSTEM.replace("dispatcher", "switchman"), "Where is car 7?")
    # no system prompt: the first prefix_tokens of the prompt, block-aligned
    assert key(None, "hi") == prefix_key(tok.encode("<user>hi\n<assistant>"), 16)
    assert PrefixKeys(prefix_tokens=0).key("m", tok, tok.encode(SYSTEM), None) == ""
    completions = PrefixKeys(prefix_tokens=64)
    assert completions.key("m", tok, tok.encode(SYSTEM + "a")) == completions.key(
        "m", tok, tok.encode(SYSTEM + "b")
    )


def test_prefix_cache_hits_leading_blocks_and_evicts_least_recent() -> None:
    cache = PrefixCache(capacity_tokens=64, block=16)  # four blocks
    system = list(range(32))
    assert cache.lookup_and_insert(system + [100] * 20) == 0
    assert cache.lookup_and_insert(system + [200] * 20) == 32  # the system prompt's blocks
    # a different first block: nothing after it counts, even if later tokens match
    assert cache.lookup_and_insert([999] + system[1:] + [100] * 20) == 0
    # four blocks held: eviction took the tails of the older prompts first; system's first
    # block was touched last by the second prompt, so a leading run still hits
    assert cache.lookup_and_insert(system) == 16
    tail_first = PrefixCache(capacity_tokens=48, block=16)
    tail_first.lookup_and_insert(system)  # blocks s0, s1
    tail_first.lookup_and_insert([500] * 16)  # one more block: three held
    tail_first.lookup_and_insert([600] * 16)  # four: s1, the tail, goes first
    assert tail_first.lookup_and_insert(system) == 16
    assert PrefixCache(0).lookup_and_insert(system) == 0
