"""A vLLM logits processor that lets a resumed sequence go on as if it had never stopped.

A redelivered job resumes from prompt + the tokens its earlier attempt streamed, given to vLLM
as one prompt (`VLLMEngine.generate`). For most decoding that is exact, but two things count
the output so far and vLLM would count only what it generates itself:

- a structured-output guide: vLLM starts its grammar at the first generated token, so the
  continuation would be a fresh JSON value (or choice, ...) after the resumed part;
- presence/frequency penalties, which vLLM applies to output tokens only.

For such a sequence the engine sends no `structured_outputs`; its `extra_args[RESUME_ARG]`
carry the guide, the penalties and how many prompt tokens were resumed, and this processor
(loaded by vLLM's engine core from `logits_processors`) replays those tokens through the same
xgrammar grammar vLLM would compile, masks each step by it, and adds the penalties the resumed
tokens earn, so the continuation is the one an unbroken run would sample (`min_tokens` the
engine lowers by the resumed count itself; the repetition penalty already covers the prompt).

This module imports vLLM: only the vLLM engine core loads it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from vllm import SamplingParams as VSamplingParams
from vllm.config import VllmConfig
from vllm.tokenizers.registry import cached_tokenizer_from_config
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
from vllm.v1.structured_output.backend_types import StructuredOutputGrammar, StructuredOutputOptions
from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend
from vllm.v1.structured_output.utils import choice_as_grammar

from tokenyard.engines.vllm import RESUME_ARG

log = logging.getLogger(__name__)

# vllm.py's guide kinds as vLLM's grammar request types (a choice is compiled as its grammar,
# as vLLM's own validation rewrites it)
_KINDS = {
    "json": StructuredOutputOptions.JSON,
    "json_object": StructuredOutputOptions.JSON_OBJECT,
    "regex": StructuredOutputOptions.REGEX,
    "grammar": StructuredOutputOptions.GRAMMAR,
}


class ResumedOutputs(AdapterLogitsProcessor):  # type: ignore[misc]
    """Applies a resumed sequence's guide and penalties to its resumed tokens too."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        super().__init__(vllm_config, device, is_pin_memory)
        self._config = vllm_config
        self._backend: XgrammarBackend | None = None

    def is_argmax_invariant(self) -> bool:
        return False  # it masks and penalises: greedy picks change

    def new_req_logits_processor(self, params: VSamplingParams) -> _Resumed | None:
        args = (params.extra_args or {}).get(RESUME_ARG)
        if not isinstance(args, dict):
            return None
        grammar = None
        guide = args.get("guide")
        if guide is not None:
            kind, spec = guide
            if kind == "choice":
                kind, spec = "grammar", choice_as_grammar(list(spec))
            try:
                grammar = self._grammars().compile_grammar(
                    _KINDS[kind], spec, stop_token_ids=set(params.all_stop_token_ids) or None
                )
            except Exception:  # raised here it would end vLLM's engine core, every request
                log.exception("a resumed sequence's grammar does not compile; unconstrained")
        return _Resumed(
            resumed=int(args["resumed"]),
            grammar=grammar,
            presence=float(args.get("presence", 0.0)),
            frequency=float(args.get("frequency", 0.0)),
            repetition=float(params.repetition_penalty),
            vocab_size=self._config.model_config.get_vocab_size(),
        )

    def _grammars(self) -> XgrammarBackend:
        # as vLLM's StructuredOutputManager builds its backend (the same tokenizer and vocab),
        # so a resumed sequence's grammar masks exactly what the unbroken one's did
        if self._backend is None:
            model = self._config.model_config
            self._backend = XgrammarBackend(
                self._config,
                tokenizer=cached_tokenizer_from_config(model_config=model),
                vocab_size=model.get_vocab_size(),
            )
        return self._backend


class _Resumed:
    """One resumed sequence's state: its grammar past the resumed tokens, their counts."""

    def __init__(
        self,
        *,
        resumed: int,
        grammar: StructuredOutputGrammar | None,
        presence: float,
        frequency: float,
        repetition: float,
        vocab_size: int,
    ) -> None:
        self.resumed = resumed
        self.grammar = grammar
        self.presence, self.frequency, self.repetition = presence, frequency, repetition
        self.vocab_size = vocab_size
        self.fed = -1  # output tokens the grammar has seen; -1: not even the resumed ones
        self.broken = False
        self.counts: Counter[int] = Counter()
        self.bitmask: torch.Tensor | None = None

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> Any:
        if self.fed < 0:
            tail = prompt_ids[len(prompt_ids) - self.resumed :]
            self.counts = Counter(tail)
            self._accept(tail)
            self.fed = 0
        self._accept(output_ids[self.fed :])
        self.fed = len(output_ids)
        if self.presence or self.frequency:
            self._penalise(logits, output_ids)
        if self.grammar is not None and not self.broken and not self.grammar.is_terminated():
            import xgrammar as xgr

            if self.bitmask is None:
                self.bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
            self.grammar.fill_bitmask(self.bitmask, 0)
            row = logits.unsqueeze(0)  # a view: the mask lands in `logits`
            xgr.apply_token_bitmask_inplace(
                row, self.bitmask.to(logits.device), vocab_size=self.vocab_size
            )
        return logits

    def _accept(self, tokens: Sequence[int]) -> None:
        if self.grammar is None or self.broken or not tokens:
            return
        if not self.grammar.accept_tokens("tokenyard-resume", list(tokens)):
            # tokens the same grammar once allowed: cannot happen unless the guide changed
            log.error("resumed tokens break the sequence's grammar; it goes on unconstrained")
            self.broken = True

    def _penalise(self, logits: torch.Tensor, output_ids: list[int]) -> None:
        """What an unbroken run would subtract for the resumed tokens: the frequency penalty
        per occurrence, and the presence penalty where vLLM's (over the new output only)
        has not already. vLLM applies the repetition penalty after this processor, to a
        prompt that holds the resumed tokens, so this aims at rep(x) - a, not rep(x - a)."""
        seen = set(output_ids)
        ids = list(self.counts)
        cut = torch.tensor(
            [
                self.frequency * self.counts[t] + (self.presence if t not in seen else 0.0)
                for t in ids
            ],
            dtype=logits.dtype,
            device=logits.device,
        )
        index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        x = logits[index]
        r = self.repetition
        if r == 1.0:
            logits[index] = x - cut
            return
        target = torch.where(x > 0, x / r, x * r) - cut
        logits[index] = torch.where(target > 0, target * r, target / r)
