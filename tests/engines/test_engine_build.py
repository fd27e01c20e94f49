"""Worker settings → engine: the one mapping (`engines.build_engine`) and the env names."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenyard.config import CONFIG_ENV, WorkerSettings, from_env
from tokenyard.engines import EngineCapacity, build_engine, engine_options
from tokenyard.engines.process import ProcessEngine
from tokenyard.engines.sim import SimEngine
from tokenyard.errors import FatalError


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
    lora = engine_options(WorkerSettings(loras=("sql=/l/sql", "chat=org/chat"), max_loras=2))
    assert lora["loras"] == {"sql": "/l/sql", "chat": "org/chat"} and lora["max_loras"] == 2
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


def _cost(engine: object) -> tuple[float, float, float, float]:
    assert isinstance(engine, SimEngine)
    return (
        engine.prefill_base,
        engine.prefill_per_token,
        engine.decode_base,
        engine.decode_per_seq,
    )


def test_sim_cost_model_from_flag_env_and_file(tmp_path: Path) -> None:
    toml = tmp_path / "tokenyard.toml"
    toml.write_text(
        "[worker]\nengine = 'sim'\nsim_decode_base_s = 0.03\nsim_prefill_base_s = 0.004\n"
    )
    env = {
        CONFIG_ENV: str(toml),
        "TOKENYARD_WORKER_SIM_DECODE_PER_SEQ_S": "0.001",
        "TOKENYARD_WORKER_SIM_PREFILL_BASE_S": "0.005",
    }
    flags = {"sim_prefill_per_token_s": 1e-4, "sim_prefill_base_s": 0.006}
    settings = from_env(WorkerSettings, "worker", env, **flags)
    # prefill base: flag over env over file; per token: flag; decode base: file; per seq: env
    assert _cost(build_engine(settings)) == (0.006, 1e-4, 0.03, 0.001)
    assert _cost(build_engine(WorkerSettings(engine="sim"))) == _cost(SimEngine())  # its own
    with pytest.raises(FatalError, match=r"sim_decode_base_s = '-1' \(from TOKENYARD_WORKER_"):
        from_env(WorkerSettings, "worker", {"TOKENYARD_WORKER_SIM_DECODE_BASE_S": "-1"})


@pytest.mark.usefixtures("root_logging")  # `worker` sets up logging in this process
def test_sim_cost_flags_of_worker_and_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from tokenyard.cli import app
    from tokenyard.cli.engine import export_to_workers, sim_cost

    seen: list[WorkerSettings] = []

    async def serve_worker(queue: object, settings: WorkerSettings, consumer: object) -> None:
        seen.append(settings)

    monkeypatch.setattr("tokenyard.worker.run.serve_worker", serve_worker)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    flags = ["--sim-prefill-base-s", "0.1", "--sim-prefill-per-token-s", "0.2"]
    flags += ["--sim-decode-base-s", "0.3", "--sim-decode-per-seq-s", "0.4"]
    args = ["worker", "--broker", "redis://127.0.0.1:1", "--engine", "sim", *flags]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert _cost(build_engine(seen[0])) == (0.1, 0.2, 0.3, 0.4)
    # serve hands its flags to the worker processes it starts through their environment
    for name in ("PREFILL_BASE_S", "DECODE_BASE_S"):  # so they are restored after the test
        monkeypatch.setenv(f"TOKENYARD_WORKER_SIM_{name}", "0")
    monkeypatch.delenv("TOKENYARD_WORKER_SIM_PREFILL_PER_TOKEN_S", raising=False)
    export_to_workers(sim_cost(0.25, None, 0.5, None))
    inherited = from_env(WorkerSettings, "worker", engine="sim")
    assert (inherited.sim_prefill_base_s, inherited.sim_decode_base_s) == (0.25, 0.5)
    assert inherited.sim_prefill_per_token_s is None
