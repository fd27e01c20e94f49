"""The response cache's key (a property test over every input) and its in-process tier."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from tokenyard.gateway.cache import (
    LocalLRU,
    cache_key,
    cache_scope,
    collapse_key,
    deterministic,
)
from tokenyard.messages import Guide, SamplingParams

_text = st.text(min_size=1, max_size=8)
sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.sampled_from([0.0, 0.5, 0.7, 1.0, 1.3]),
    top_p=st.sampled_from([0.1, 0.9, 1.0]),
    top_k=st.integers(0, 100),
    seed=st.none() | st.integers(0, 2**32),
    stop=st.lists(_text, max_size=3).map(tuple),
    ignore_eos=st.booleans(),
)
requests = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["tiny", "big", "small"]),
        "revision": st.sampled_from(["r1", "r2", "hf:abc:float32"]),
        "scope": st.sampled_from([cache_scope("acme", False), cache_scope("other", False)])
        | st.just(cache_scope("acme", True)),
        "prompt_token_ids": st.lists(st.integers(0, 50_000), min_size=1, max_size=20),
        "sampling": sampling_params,
    }
)


def _changed(field: str, value: object, draw: st.DrawFn) -> object:
    """A value of `field` different from `value`."""
    if field == "sampling":
        assert isinstance(value, SamplingParams)
        name = draw(st.sampled_from([f.name for f in msgspec.structs.fields(SamplingParams)]))
        strategy = {
            "max_tokens": st.integers(1, 4096),
            "temperature": st.sampled_from([0.0, 0.2, 0.5, 1.0, 1.9]),
            "top_p": st.sampled_from([0.05, 0.5, 1.0]),
            "top_k": st.integers(0, 100),
            "seed": st.none() | st.integers(0, 2**32),
            "stop": st.lists(_text, max_size=3).map(tuple),
            "ignore_eos": st.booleans(),
            "presence_penalty": st.sampled_from([-1.0, 0.0, 0.5, 2.0]),
            "frequency_penalty": st.sampled_from([-1.0, 0.0, 0.5, 2.0]),
            "repetition_penalty": st.sampled_from([0.5, 1.0, 1.2]),
            "logit_bias": st.lists(
                st.tuples(st.integers(0, 1000), st.sampled_from([-100.0, 1.0])), max_size=2
            ).map(tuple),
            "min_tokens": st.integers(0, 8),
            "stop_token_ids": st.lists(st.integers(0, 1000), max_size=2).map(tuple),
            "logprobs": st.none() | st.integers(0, 20),
            "guide": st.none()
            | st.builds(Guide, json=st.sampled_from(['{"type": "object"}', '{"type": "array"}']))
            | st.builds(Guide, regex=st.sampled_from(["a+", "[0-9]{3}"]))
            | st.builds(Guide, choice=st.lists(_text, min_size=1, max_size=3).map(tuple))
            | st.just(Guide(json_object=True)),
            "min_p": st.sampled_from([0.0, 0.05, 0.5, 1.0]),
            "allowed_token_ids": st.lists(st.integers(0, 1000), max_size=3).map(tuple),
            "bad_words": st.lists(_text, max_size=2).map(tuple),
            "skip_special_tokens": st.booleans(),
            "spaces_between_special_tokens": st.booleans(),
            "include_stop_str_in_output": st.booleans(),
            "cache_salt": st.none() | _text,
            "prompt_logprobs": st.none() | st.integers(0, 20),
        }[name]
        new = draw(strategy.filter(lambda v: v != getattr(value, name)))
        return msgspec.structs.replace(value, **{name: new})
    if field == "scope":
        return draw(st.sampled_from(["t:acme", "t:other", "*", "t:x"]).filter(lambda v: v != value))
    if field == "prompt_token_ids":
        assert isinstance(value, list)
        return draw(
            st.lists(st.integers(0, 50_000), min_size=1, max_size=20).filter(lambda v: v != value)
        )
    return draw(st.text(min_size=1, max_size=12).filter(lambda v: v != value))


@given(
    requests,
    st.sampled_from(["model", "revision", "scope", "prompt_token_ids", "sampling"]),
    st.data(),
)
def test_any_change_of_an_input_is_a_miss(
    request: dict[str, object], field: str, data: st.DataObject
) -> None:
    key = cache_key(**request)  # type: ignore[arg-type]
    assert key == cache_key(**request)  # type: ignore[arg-type]  # pure: the same inputs hit
    changed = {**request, field: _changed(field, request[field], data.draw)}
    assert cache_key(**changed) != key  # type: ignore[arg-type]


def test_a_tenant_sees_only_its_own_answers_unless_shared() -> None:
    assert cache_scope("acme", False) != cache_scope("other", False)
    assert cache_scope("acme", True) == cache_scope("other", True)


def test_deterministic_means_greedy_or_seeded() -> None:
    assert deterministic(SamplingParams(temperature=0.0))
    assert deterministic(SamplingParams(temperature=0.8, seed=7))
    assert not deterministic(SamplingParams(temperature=0.8))


def test_streaming_and_sync_calls_collapse_apart() -> None:
    assert collapse_key("d", True) != collapse_key("d", False)


def test_local_tier_evicts_least_recently_used_past_its_bytes_and_expires() -> None:
    now = [0.0]
    lru = LocalLRU(max_bytes=10, ttl_s=5.0, clock=lambda: now[0])
    lru.put("a", b"aaaa")
    lru.put("b", b"bbbb")
    assert lru.get("a") == b"aaaa"  # now b is the least recently used
    lru.put("c", b"cccc")
    assert lru.get("b") is None and lru.get("a") and lru.get("c")
    assert lru.bytes == 8
    lru.put("big", b"x" * 11)  # larger than the bound: not kept, evicts nothing
    assert lru.get("big") is None and lru.bytes == 8
    now[0] = 5.0
    assert lru.get("a") is None and lru.bytes == 4


def test_embeddings_inputs_split_differently_are_different_answers() -> None:
    greedy = SamplingParams(max_tokens=0, temperature=0.0)
    ids = [5, 6, 7]
    keys = {
        cache_key("m", "r", "*", ids, greedy, lengths)
        for lengths in (None, [3], [1, 2], [2, 1], [1, 1, 1])
    }
    assert len(keys) == 5
