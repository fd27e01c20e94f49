"""The request fields' conversions and the logprobs' OpenAI shapes, without a server."""

from __future__ import annotations

import math

import pytest

from tokenyard.engines.sim import SimTokenizer
from tokenyard.errors import InvalidRequest
from tokenyard.gateway.admission import _child_seed
from tokenyard.gateway.protocol import (
    INT64_MAX,
    INT64_MIN,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    priority_class,
    usage_of_choices,
)
from tokenyard.messages import JobResult, JobStatus, Priority, TokenLogprob

TOK = SimTokenizer()


def _completion(**fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})


def test_logit_bias_keys_become_sorted_token_ids() -> None:
    assert _completion(logit_bias={"10": 1, "-0": -2, "+3": 5}).logit_bias_ids == (
        (0, -2.0),
        (3, 5.0),
        (10, 1.0),
    )
    assert _completion().logit_bias_ids == ()
    for key in ("a", "1.5", " 1", "", "1" * 20, "\u0661"):
        with pytest.raises(InvalidRequest) as refused:
            _ = _completion(logit_bias={key: 1}).logit_bias_ids
        assert refused.value.param == "logit_bias"


def test_logprobs_counts() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(chat).logprobs_count is None
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}).logprobs_count == 0
    both = {**chat, "logprobs": True, "top_logprobs": 4}
    assert ChatCompletionRequest.model_validate(both).logprobs_count == 4
    assert _completion(logprobs=0).logprobs_count == 0
    assert _completion().logprobs_count is None


def test_child_seeds_stay_in_int64() -> None:
    assert [_child_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert _child_seed(INT64_MAX, 1) == INT64_MIN
    assert _child_seed(-1, 1) == 0


LOGPROBS = [
    TokenLogprob(
        TOK.encode("a")[0], -0.5, ((TOK.encode("a")[0], -0.5), (TOK.encode("b")[0], -1.0))
    ),
    TokenLogprob(TOK.encode("c")[0], -math.inf, ()),
]


def test_chat_logprobs_shape() -> None:
    body = chat_logprobs(LOGPROBS, TOK.token_text)
    assert body["refusal"] is None
    first, second = body["content"]
    assert first == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]},
            {"token": "b", "logprob": -1.0, "bytes": [98]},
        ],
    }
    assert second["logprob"] == -9999.0  # JSON has no -inf
    assert second["top_logprobs"] == []


def test_completion_logprobs_shape_and_offsets() -> None:
    body = completion_logprobs(LOGPROBS, TOK.token_text, offset=5)
    assert body == {
        "tokens": ["a", "c"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"a": -0.5, "b": -1.0}, {"c": -9999.0}],  # the chosen one is always in
        "text_offset": [5, 6],
    }


def test_usage_counts_the_prompt_once() -> None:
    results = [
        JobResult(status=JobStatus.SUCCEEDED, prompt_tokens=10, completion_tokens=n) for n in (3, 4)
    ]
    assert usage_of_choices(results) == {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "total_tokens": 17,
    }


def test_vllm_priorities_map_onto_lanes() -> None:
    assert [priority_class(p) for p in (None, 0, -5, 3, "high", "low")] == [
        None,
        None,
        Priority.HIGH,
        Priority.LOW,
        Priority.HIGH,
        Priority.LOW,
    ]


def test_truncation_keeps_the_end_or_the_start() -> None:
    ids = list(range(10))
    assert _completion(truncate_prompt_tokens=3).truncated(ids, 100) == [7, 8, 9]
    right = _completion(truncate_prompt_tokens=3, truncation_side="right")
    assert right.truncated(ids, 100) == [0, 1, 2]
    assert _completion(truncate_prompt_tokens=-1).truncated(ids, 4) == [6, 7, 8, 9]
    assert _completion(truncate_prompt_tokens=20).truncated(ids, 100) is ids
    assert _completion().truncated(ids, 4) is ids


def test_vllm_only_fields_pass_when_neutral_and_are_refused_by_name_otherwise() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    for field, value, neutral in (
        ("use_beam_search", False, True),
        ("use_beam_search", True, False),
        ("length_penalty", 1, True),
        ("length_penalty", 0.5, False),
        ("request_id", None, True),
        ("request_id", "r1", False),
        ("echo", False, True),  # chat's own echo
        ("echo", True, False),
    ):
        request = ChatCompletionRequest.model_validate({**chat, field: value})
        if neutral:
            request.refuse_unsupported()
            continue
        with pytest.raises(InvalidRequest) as refused:
            request.refuse_unsupported()
        assert refused.value.param == field and refused.value.code == "unsupported_parameter"
    with pytest.raises(InvalidRequest) as unknown:
        _completion(not_a_field=1).refuse_unsupported()
    assert unknown.value.code == "unknown_parameter"


def test_batched_prompts_count_each_prompt_once() -> None:
    def done(prompt: int, completion: int) -> JobResult:
        return JobResult(
            status=JobStatus.SUCCEEDED, prompt_tokens=prompt, completion_tokens=completion
        )

    results = [done(5, 1), done(5, 2), done(7, 3), done(7, 4)]
    assert usage_of_choices(results, per_prompt=2) == {
        "prompt_tokens": 12,
        "completion_tokens": 10,
        "total_tokens": 22,
    }
    assert usage_of_choices(results)["prompt_tokens"] == 5
