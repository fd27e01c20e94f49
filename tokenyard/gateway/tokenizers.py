"""Loads the tokenizer of each served model, the same way the workers' engines do."""

from __future__ import annotations

from tokenyard.engines.base import EngineTokenizer
from tokenyard.gateway.settings import GatewaySettings


def load_tokenizer(family: str, model: str) -> EngineTokenizer:
    """ "sim": the simulator's byte tokenizer; "hf": the model's own (a local path or `tiny`)."""
    if family == "sim":
        from tokenyard.engines.sim import SimTokenizer

        return SimTokenizer()
    if family == "hf":
        from tokenyard.engines.hf_tokenizer import load_hf_tokenizer, resolve_model_path

        return load_hf_tokenizer(resolve_model_path(model))
    raise ValueError(f"unknown tokenizer family {family!r}; expected 'hf' or 'sim'")


def load_tokenizers(settings: GatewaySettings) -> dict[str, EngineTokenizer]:
    return {model: load_tokenizer(settings.tokenizer, model) for model in settings.models}
