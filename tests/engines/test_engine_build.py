"""Worker settings → engine: the one mapping (`engines.build_engine`) and the env names."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenyard.config import WorkerSettings, from_env
from tokenyard.engines import EngineCapacity, build_engine, engine_options
from tokenyard.engines.process import ProcessEngine
from tokenyard.engines.sim import SimEngine


def test_engine_options_leave_unset_capacity_to_the_engine() -> None:
    assert engine_options(WorkerSettings(engine="sim")) == {}
    assert engine_options(WorkerSettings(engine="sim", max_seqs=8, token_budget=99)) == {
        "max_seqs": 8,
        "max_tokens": 99,
    }
    hf = engine_options(WorkerSettings(model="m", max_seqs=16, cuda_graphs=False, warmup=False))
    assert hf == {
        "model": "m",
        "device": "auto",
        "dtype": "auto",
        "max_seqs": 16,
        "cuda_graphs": False,
        "warmup": False,
    }
    full = WorkerSettings(max_batch_tokens=1024, kv_cache_memory_fraction=0.5, threads=2)
    assert engine_options(full)["max_batch_tokens"] == 1024
    assert engine_options(full)["kv_cache_memory_fraction"] == 0.5
    assert engine_options(full)["threads"] == 2
    # The static baseline batches what the worker may hold; it has no cache to size.
    assert engine_options(WorkerSettings(engine="hf-static", max_seqs=4))["batch_size"] == 4
    assert engine_options(WorkerSettings(engine="hf-static"))["batch_size"] == 32
    assert "cuda_graphs" not in engine_options(WorkerSettings(engine="hf-static"))


def test_build_engine_in_thread_or_in_a_process() -> None:
    sim = build_engine(WorkerSettings(engine="sim", max_seqs=8, token_budget=1000))
    assert isinstance(sim, SimEngine) and sim.capacity == EngineCapacity(8, 1000)
    assert SimEngine().capacity == EngineCapacity(64, 64 * 4096)  # defaults: the whole context
    # Built, not started: the child process is spawned by start().
    proc = build_engine(WorkerSettings(engine="sim", max_seqs=8, engine_process=True))
    assert isinstance(proc, ProcessEngine) and proc.capacity.max_seqs == 8
    assert proc.pid is None


def test_build_hf_engine(tiny_model_path: Path) -> None:
    from tokenyard.engines.hf import HFEngine

    settings = WorkerSettings(model=str(tiny_model_path), max_seqs=16, token_budget=4096)
    engine = build_engine(settings)
    assert isinstance(engine, HFEngine)
    assert engine.capacity == EngineCapacity(16, 4096)
    assert engine.limits().context == 2048


def test_worker_settings_from_env() -> None:
    env = {
        "TOKENYARD_WORKER_MAX_SEQS": "12",
        "TOKENYARD_WORKER_CUDA_GRAPHS": "false",
        "TOKENYARD_WORKER_KV_CACHE_MEMORY_FRACTION": "0.5",
        "TOKENYARD_WORKER_MAX_BATCH_TOKENS": "2048",
        "TOKENYARD_WORKER_DTYPE": "bfloat16",
    }
    s = from_env(WorkerSettings, "worker", env)
    assert (s.max_seqs, s.token_budget, s.cuda_graphs, s.warmup) == (12, None, False, True)
    assert (s.kv_cache_memory_fraction, s.max_batch_tokens, s.dtype) == (0.5, 2048, "bfloat16")
    assert from_env(WorkerSettings, "worker", {}).device == "auto"
    with pytest.raises(Exception, match="dtype"):
        from_env(WorkerSettings, "worker", {"TOKENYARD_WORKER_DTYPE": "int3"})
