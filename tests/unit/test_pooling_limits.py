"""The one rule for embeddings and scoring jobs' options (tokenyard.limits), pure: a scoring job
needs a cross-encoder, `dimensions` a matryoshka model, and several workers' limits merge to
what the most capable takes."""

from __future__ import annotations

from tokenyard.limits import embedding_refusal, loosest
from tokenyard.messages import ModelLimits, PoolingOptions

EMBEDS = ModelLimits(max_model_len=16, max_seqs=4, token_budget=64, generates=False, embeds=True)
SCORES = ModelLimits(max_model_len=16, max_seqs=4, token_budget=64, generates=False, scores=True)
ANY = ModelLimits(
    max_model_len=16, max_seqs=4, token_budget=64, generates=False, embeds=True, matryoshka=True
)
SOME = ModelLimits(
    max_model_len=16,
    max_seqs=4,
    token_budget=64,
    generates=False,
    embeds=True,
    matryoshka=True,
    matryoshka_dimensions=(8, 16),
)


def test_scoring_needs_a_cross_encoder_and_each_pairs_second_text() -> None:
    pairs = PoolingOptions(score=True, second=(2, 3))
    assert embedding_refusal([4, 5], SCORES, pooling=pairs) is None
    refused = embedding_refusal([4, 5], EMBEDS, pooling=pairs)
    assert refused is not None and (refused.param, refused.code) == ("model", "model_not_supported")
    assert "not a cross-encoder" in refused.message
    # and a cross-encoder has no vectors to give
    refused = embedding_refusal([4, 5], SCORES)
    assert refused is not None and "does not serve embeddings" in refused.message
    refused = embedding_refusal([4, 5], SCORES, pooling=PoolingOptions(score=True, second=(2,)))
    assert refused is not None and refused.param == "input"
    # a pair is an input like any other: it must fit the context
    refused = embedding_refusal([4, 17], SCORES, "documents", pooling=pairs)
    assert refused is not None and (refused.param, refused.code) == (
        "documents",
        "context_length_exceeded",
    )


def test_dimensions_need_a_matryoshka_model_and_one_of_its_sizes() -> None:
    for limits, size, refused in (
        (EMBEDS, 8, True),
        (ANY, 8, False),
        (ANY, 31, False),
        (SOME, 16, False),
        (SOME, 12, True),
    ):
        error = embedding_refusal([3], limits, pooling=PoolingOptions(dimensions=size))
        assert (error is not None) is refused, (limits, size)
        if error is not None:
            assert (error.param, error.code) == ("dimensions", "unsupported_parameter")
    error = embedding_refusal([3], SOME, pooling=PoolingOptions(dimensions=12))
    assert error is not None and "only supports [8, 16] matryoshka dimensions" in error.message
    # normalisation alone asks nothing of the model
    assert embedding_refusal([3], EMBEDS, pooling=PoolingOptions(normalize=False)) is None


def test_several_workers_take_what_the_most_capable_takes() -> None:
    merged = loosest([EMBEDS, SCORES, SOME])
    assert merged is not None and merged.scores and merged.embeds
    assert (merged.matryoshka, merged.matryoshka_dimensions) == (True, (8, 16))
    merged = loosest([SOME, ANY])
    assert merged is not None and (merged.matryoshka, merged.matryoshka_dimensions) == (True, ())
    merged = loosest([EMBEDS])
    assert merged is not None and not merged.matryoshka and not merged.scores
