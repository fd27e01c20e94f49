"""Penalties, logit bias and masks (vLLM's formulas) on tensors: each formula against a plain
per-element loop, and the engine's dense buffers against the formulas."""

from __future__ import annotations

import itertools
import math

import pytest

torch = pytest.importorskip("torch")

from tokenyard.engines.sampling import (  # noqa: E402
    AdjustBuffers,
    LogprobBuffers,
    RowFeatures,
    apply_frequency_presence,
    apply_logit_bias,
    apply_repetition_penalty,
    unpack_bitmask,
)
from tokenyard.messages import SamplingParams  # noqa: E402

VOCAB = 12


def logits(rows: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    s = logits()
    seen = torch.zeros_like(s, dtype=torch.bool)
    seen[0, [1, 2, 5]] = True
    seen[1, [0, 7]] = True
    penalty = torch.tensor([1.5, 0.8])
    out = apply_repetition_penalty(s, seen, penalty)
    for r in range(2):
        p = float(penalty[r])
        for t in range(VOCAB):
            x = float(s[r, t])
            want = (x / p if x > 0 else x * p) if seen[r, t] else x
            assert math.isclose(float(out[r, t]), want, rel_tol=1e-6)


def test_frequency_and_presence_penalties_follow_openai() -> None:
    s = logits()
    counts = torch.zeros_like(s)
    counts[0, 3] = 4
    counts[1, [3, 9]] = torch.tensor([1.0, 2.0])
    freq, pres = torch.tensor([0.5, -1.0]), torch.tensor([1.25, 0.75])
    out = apply_frequency_presence(s, counts, freq, pres)
    for r in range(2):
        for t in range(VOCAB):
            c = float(counts[r, t])
            want = float(s[r, t]) - float(freq[r]) * c - float(pres[r]) * (c > 0)
            assert math.isclose(float(out[r, t]), want, rel_tol=1e-6, abs_tol=1e-6)


def test_logit_bias_is_added() -> None:
    s = logits()
    bias = torch.zeros_like(s)
    bias[1, 4] = -100.0
    assert torch.equal(apply_logit_bias(s, bias) - s, bias)


def test_buffers_apply_every_feature_in_vllm_order() -> None:
    """bias first, then repetition over prompt+output, then frequency/presence over the output,
    and min_tokens masking the stop ids; a row without features stays as it was."""
    params = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.3,
        logit_bias=((2, 5.0), (6, -3.0)),
        min_tokens=4,
        stop_token_ids=(11,),
    )
    f = RowFeatures(params, prompt_ids=[1, 2, 3], output_ids=[3, 4, 4], stop_ids=[0])
    assert f.adjusts
    s = logits(3)
    buffers = AdjustBuffers(4, VOCAB, torch.device("cpu"))
    buffers.fill([(1, f)])
    out = buffers.apply(s)
    assert torch.equal(out[0], s[0]) and torch.equal(out[2], s[2])

    row = s[1:2].clone()
    bias = torch.zeros_like(row)
    bias[0, 2], bias[0, 6] = 5.0, -3.0
    want = apply_logit_bias(row, bias)
    seen = torch.zeros_like(row, dtype=torch.bool)
    seen[0, [1, 2, 3, 4]] = True
    want = apply_repetition_penalty(want, seen, torch.tensor([1.3]))
    counts = torch.zeros_like(row)
    counts[0, 3], counts[0, 4] = 1, 2
    want = apply_frequency_presence(want, counts, torch.tensor([0.25]), torch.tensor([0.5]))
    want[0, [0, 11]] = float("-inf")  # 3 of 4 min_tokens generated: EOS and the stop id held
    assert torch.allclose(out[1:2], want)

    # Once min_tokens is reached the mask goes; the next fill resets the rows it does not name.
    f.push([5])
    buffers.fill([(2, f)])
    out = buffers.apply(s)
    assert torch.equal(out[1], s[1]) and torch.isfinite(out[2]).all()
    buffers.fill([])
    assert torch.equal(buffers.apply(s), s) and not buffers.dirty


def test_guided_row_keeps_only_allowed_tokens() -> None:
    allowed = {1, 5, 9}

    class OnlySome:
        def fill(self, bitmask: torch.Tensor, row: int) -> None:
            bitmask[row] = 0
            for t in allowed:
                bitmask[row, t // 32] |= 1 << (t % 32)

        def accept(self, token_id: int) -> bool:
            return token_id in allowed

        @property
        def terminated(self) -> bool:
            return False

    f = RowFeatures(SamplingParams(), prompt_ids=[], matcher=OnlySome())
    buffers = AdjustBuffers(2, VOCAB, torch.device("cpu"))
    buffers.fill([(0, f)])
    s = logits()
    out = buffers.apply(s)
    assert {t for t in range(VOCAB) if math.isfinite(float(out[0, t]))} == allowed
    assert torch.equal(out[0, sorted(allowed)], s[0, sorted(allowed)])
    assert torch.equal(out[1], s[1])


def test_unpack_bitmask_matches_xgrammar_layout() -> None:
    words = torch.tensor([[0b101, -(2**31)], [0, 1]], dtype=torch.int32)
    mask = unpack_bitmask(words, 33)
    assert mask.shape == (2, 33)
    assert mask[0].nonzero().flatten().tolist() == [0, 2]  # bit 31 (token 63) is past the vocab
    assert mask[1].nonzero().flatten().tolist() == [32]


def test_logprob_buffers_record_raw_logprobs_of_the_chosen_token() -> None:
    raw = logits(2)
    processed = raw.clone()
    processed[1, 7] = 1e9  # the sampled token of row 1 is not its most likely one
    buffers = LogprobBuffers(4, VOCAB, torch.device("cpu"))
    buffers.record(raw, processed)
    (c0, _, top0), (c1, lp1, top1) = buffers.read(2)
    ref = raw.log_softmax(-1)
    assert c0 == int(raw[0].argmax()) and top0[0][0] == c0
    assert c1 == 7 and math.isclose(lp1, float(ref[1, 7]), rel_tol=1e-6)
    assert [t for t, _ in top1] == ref[1].topk(VOCAB).indices.tolist()[: len(top1)]
    assert all(a[1] >= b[1] for a, b in itertools.pairwise(top0))
    # every recorded value is the full log_softmax's, without computing it
    for row, (_, _, top) in enumerate(buffers.read(2)):
        for t, lp in top:
            assert math.isclose(lp, float(ref[row, t]), rel_tol=1e-6, abs_tol=1e-6)


def test_logprob_buffers_stay_finite_for_huge_and_half_precision_logits() -> None:
    raw = (logits(2) * 1e3).half()  # exp would overflow unshifted, in fp16 most of all
    buffers = LogprobBuffers(2, VOCAB, torch.device("cpu"))
    buffers.record(raw, raw)
    ref = raw.float().log_softmax(-1)
    for row, (c, lp, top) in enumerate(buffers.read(2)):
        assert math.isclose(lp, float(ref[row, c]), rel_tol=1e-6, abs_tol=1e-4)
        assert [t for t, _ in top] == ref[row].topk(len(top)).indices.tolist()
        assert all(math.isfinite(v) for _, v in top)
