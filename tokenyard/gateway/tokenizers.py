"""Loads the tokenizer of each served model, the same way the workers' engines do."""

from __future__ import annotations

from tokenyard.engines.base import EngineTokenizer
from tokenyard.gateway.settings import GatewaySettings, served_models


def load_tokenizer(family: str, model: str, revision: str | None = None) -> EngineTokenizer:
    """ "sim": the simulator's byte tokenizer; "hf": the model's own (a local directory, a hub
    id through the Hugging Face cache, or `tiny`)."""
    if family == "sim":
        from tokenyard.engines.sim import SimTokenizer

        return SimTokenizer()
    if family == "hf":
        from tokenyard.engines.hf_tokenizer import load_hf_tokenizer, resolve_model_path

        # a gateway never loads the weights: a hub id's are not fetched for it
        return load_hf_tokenizer(resolve_model_path(model, revision, weights=False))
    raise ValueError(f"unknown tokenizer family {family!r}; expected 'hf' or 'sim'")


def load_tokenizers(settings: GatewaySettings) -> dict[str, EngineTokenizer]:
    """Each served model's tokenizer, keyed by the model's name on the lanes."""
    served = served_models(settings)
    return {
        name: load_tokenizer(settings.tokenizer, source, served.revision)
        for name, source in served.sources.items()
    }
