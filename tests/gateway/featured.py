"""A sim engine that declares every optional decoding feature, for tests of the gateway's side
of them (what is accepted, how it is rendered, cached and fanned out) without a real model.

It makes up logprobs (a fixed function of each token: the chosen token is always the most
likely) and honours nothing else of what it declares; values that depend on the model are
tested against the tiny hf model (tests/gateway/test_sampling_tiny.py).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from tokenyard.engines.base import Engine, EngineRequest, StepOutput
from tokenyard.engines.sim import SimEngine, SimTokenizer
from tokenyard.messages import Feature, TokenLogprob


def made_up_logprob(token_id: int) -> float:
    return -0.25 - (token_id % 5) / 10


def alternatives(token_id: int, k: int) -> tuple[tuple[int, float], ...]:
    """The chosen token first, then k - 1 others, each less likely."""
    others = [t for t in range(SimTokenizer.OFFSET + 97, SimTokenizer.vocab_size) if t != token_id]
    top = [(token_id, made_up_logprob(token_id))]
    top += [(t, made_up_logprob(token_id) - 1.0 - i) for i, t in enumerate(others[: k - 1])]
    return tuple(top[:k])


class FeaturedSim(SimEngine):
    name = "featured-sim"
    features = frozenset(Feature)

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._logprobs: dict[str, int] = {}  # seq id -> alternatives asked for

    def add(self, request: EngineRequest) -> None:
        if request.params.logprobs is not None:
            self._logprobs[request.seq_id] = request.params.logprobs
        guide = request.params.guide
        if guide is not None and (guide.regex is not None or guide.grammar is not None):
            # the plain sim refuses what it cannot follow; this one honours no guide at all
            params = msgspec.structs.replace(request.params, guide=None)
            request = msgspec.structs.replace(request, params=params)
        super().add(request)

    def _deliver(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            k = self._logprobs.get(out.seq_id)
            if k is not None:
                out.logprobs = [
                    TokenLogprob(t, made_up_logprob(t), alternatives(t, k)) for t in out.token_ids
                ]
                if out.finish_reason is not None:
                    del self._logprobs[out.seq_id]
        super()._deliver(outputs)


def featured_engine(step_s: float = 0.002) -> Callable[[], Engine]:
    return lambda: FeaturedSim(
        prefill_base=0.001, prefill_per_token=0.0, decode_base=step_s, decode_per_seq=0.0
    )
