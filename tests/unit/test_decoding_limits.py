"""The one limits rule over the decoding fields: ranges, and a feature the model's engine does
not implement refused by the parameter that asks for it, naming the engine."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from tokenyard.errors import InvalidRequest
from tokenyard.limits import loosest, refusal
from tokenyard.messages import Feature, Guide, ModelLimits, SamplingParams, decode, encode

LIMITS = ModelLimits(max_model_len=512, max_seqs=4, token_budget=2048, vocab_size=100)

ASKING = [
    (SamplingParams(presence_penalty=0.5), Feature.PENALTIES, "presence_penalty"),
    (SamplingParams(frequency_penalty=-0.5), Feature.PENALTIES, "frequency_penalty"),
    (SamplingParams(repetition_penalty=1.2), Feature.PENALTIES, "repetition_penalty"),
    (SamplingParams(logit_bias=((3, 1.0),)), Feature.LOGIT_BIAS, "logit_bias"),
    (SamplingParams(min_tokens=2), Feature.MIN_TOKENS, "min_tokens"),
    (SamplingParams(stop_token_ids=(7,)), Feature.STOP_TOKEN_IDS, "stop_token_ids"),
    (SamplingParams(logprobs=0), Feature.LOGPROBS, "logprobs"),
    (SamplingParams(guide=Guide(regex="a+")), Feature.STRUCTURED_OUTPUTS, "response_format"),
]


@pytest.mark.parametrize(("params", "feature", "param"), ASKING)
def test_a_missing_feature_is_refused_by_its_parameter_naming_the_engine(
    params: SamplingParams, feature: Feature, param: str
) -> None:
    assert params.features == {feature}
    without = replace(LIMITS, engine="bare", features=frozenset())
    refused = refusal(4, params, without)
    assert refused is not None
    assert refused.param == param and refused.code == "unsupported_parameter"
    assert "bare engine" in refused.message
    featured = replace(LIMITS, features=frozenset({feature}))
    assert refusal(4, params, featured) is None


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=-2.5), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logit_bias=((100, 1.0),)), "logit_bias"),  # past the vocabulary
        (SamplingParams(logit_bias=((3, 101.0),)), "logit_bias"),
        (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
        (SamplingParams(stop_token_ids=(-1,)), "stop_token_ids"),
        (SamplingParams(logprobs=21), "logprobs"),
    ],
)
def test_values_out_of_range_are_refused_by_name(params: SamplingParams, param: str) -> None:
    everything = replace(LIMITS, features=frozenset(Feature))
    refused = refusal(4, params, everything)
    assert refused is not None and refused.param == param


def test_the_loosest_of_several_workers_has_every_feature_any_of_them_has() -> None:
    one = replace(LIMITS, engine="a", features=frozenset({Feature.LOGPROBS}))
    two = replace(LIMITS, engine="b", features=frozenset({Feature.MIN_TOKENS}))
    merged = loosest([one, two])
    assert merged is not None
    assert merged.features == {Feature.LOGPROBS, Feature.MIN_TOKENS} and merged.engine == ""
    same = loosest([one, one])
    assert same is not None and same.engine == "a"


def test_a_heartbeat_naming_a_feature_this_version_does_not_know_still_decodes() -> None:
    newer = encode(replace(LIMITS, features=frozenset({"logprobs", "speculative_fields"})))
    limits = decode(newer, ModelLimits)
    assert "speculative_fields" in limits.features
    assert refusal(4, SamplingParams(logprobs=1), limits) is None


@pytest.mark.parametrize(
    ("guide", "field"),
    [
        (Guide(json='{"type": "object"}'), ("json", '{"type": "object"}')),
        (Guide(json_object=True), ("json_object", True)),
        (Guide(regex="a+"), ("regex", "a+")),
        (Guide(choice=("a", "b")), ("choice", ("a", "b"))),
        (Guide(choice=()), ("choice", ())),  # set, if empty: the compiler refuses it
        (Guide(grammar='root ::= "x"'), ("grammar", 'root ::= "x"')),
    ],
)
def test_a_guide_names_its_one_field(guide: Guide, field: tuple[str, object]) -> None:
    assert guide.field == field


@pytest.mark.parametrize("guide", [Guide(), Guide(regex="a", choice=("a",))])
def test_a_guide_of_none_or_two_fields_is_refused(guide: Guide) -> None:
    with pytest.raises(InvalidRequest, match="exactly one of") as err:
        _ = guide.field
    assert err.value.param == "response_format"


def test_what_depends_on_the_output_and_min_tokens_left_after_a_resume() -> None:
    assert not SamplingParams(repetition_penalty=1.5, logit_bias=((1, 1.0),)).depends_on_output
    for params in (
        SamplingParams(guide=Guide(regex="a")),
        SamplingParams(presence_penalty=0.1),
        SamplingParams(frequency_penalty=-0.1),
    ):
        assert params.depends_on_output
    params = SamplingParams(min_tokens=5)
    assert [params.min_tokens_left(n) for n in (0, 3, 5, 9)] == [5, 2, 0, 0]
