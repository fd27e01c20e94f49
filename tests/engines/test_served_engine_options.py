"""Worker settings → vllm / remote engine arguments (no vLLM needed: nothing is loaded)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tokenyard.config import WorkerSettings, from_env
from tokenyard.engines import make_engine, served_engine_options
from tokenyard.engines.remote import RemoteEngine
from tokenyard.engines.vllm import VLLMEngine

SPEC = '{"method": "ngram", "num_speculative_tokens": 2}'


def test_vllm_settings_become_engine_args() -> None:
    settings = from_env(
        WorkerSettings,
        "worker",
        environ={
            "TOKENYARD_WORKER_ENGINE": "vllm",
            "TOKENYARD_WORKER_MAX_SEQS": "48",
            "TOKENYARD_WORKER_VLLM_MAX_MODEL_LEN": "1024",
            "TOKENYARD_WORKER_VLLM_ENABLE_PREFIX_CACHING": "true",
            "TOKENYARD_WORKER_VLLM_SPECULATIVE_CONFIG": SPEC,
            "TOKENYARD_WORKER_VLLM_ARGS": '{"seed": 3, "block_size": 32}',
        },
    )
    engine = make_engine("vllm", **served_engine_options(settings))
    assert isinstance(engine, VLLMEngine)
    args = engine.engine_args
    assert args["model"].endswith("tiny-llama-hd32")  # `tiny` means the head-size-32 variant
    assert args["max_num_seqs"] == 48 and args["max_model_len"] == 1024
    assert args["enable_prefix_caching"] is True
    assert args["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 2}
    assert args["seed"] == 3 and args["block_size"] == 32
    assert args["scheduling_policy"] == "priority"
    assert "quantization" not in args  # unset options keep vLLM's defaults
    # known before start: what the worker publishes and refuses by
    assert engine.tokenizer.max_model_len == 1024
    assert engine.capacity.max_seqs == 48


def test_remote_settings_become_engine_args() -> None:
    settings = WorkerSettings(
        engine="remote", remote_url="http://up:9000/", remote_model="m", remote_concurrency=7
    )
    engine = make_engine("remote", **served_engine_options(settings))
    assert isinstance(engine, RemoteEngine)
    assert engine.url == "http://up:9000" and engine.upstream_model == "m"
    assert engine.capacity.max_seqs == 7
    with pytest.raises(ValueError):
        served_engine_options(WorkerSettings(engine="sim"))
