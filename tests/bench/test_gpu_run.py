"""The GPU run's pieces that need no GPU: the random-Llama builder, the engine ceiling's
options and the summary table."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

from bench import engine_ceiling
from bench.gpu import make_model, summary
from tokenyard.bench.workload import synthetic_prompt

REPO = Path(__file__).resolve().parents[2]


def test_make_model_builds_a_loadable_llama(tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    opts = make_model.parse(
        ["--out", str(tmp_path / "m"), "--size", "tiny", "--dtype", "float32", "--vocab", "600"]
    )
    built = make_model.build(opts)
    config = AutoConfig.from_pretrained(built["path"])
    tok = AutoTokenizer.from_pretrained(built["path"])
    assert config.vocab_size == len(tok) == built["shape"]["vocab"] == 600
    assert config.num_hidden_layers == 2 and config.hidden_size == 64
    assert built["parameters"] > 0 and built["weight_bytes"] >= 4 * built["parameters"]
    # every id the model can emit decodes, and the benchmark's prompts round-trip
    assert tok.decode(list(range(len(tok))))
    prompt = synthetic_prompt(32, random.Random(0))
    assert tok.decode(tok.encode(prompt), skip_special_tokens=True) == prompt


def test_one_b_shape_is_tinyllamas() -> None:
    shape = make_model.SIZES["1b"]
    per_layer = 2 * shape["hidden"] ** 2 + 2 * shape["hidden"] * 64 * shape["kv_heads"]
    per_layer += 3 * shape["hidden"] * shape["intermediate"]
    total = shape["layers"] * per_layer + 2 * shape["vocab"] * shape["hidden"]
    assert 1.0e9 < total < 1.2e9


def test_engine_ceiling_options() -> None:
    opts = engine_ceiling.parse(["--concurrency", "64", "--log-dir", "/x", "--no-cuda-graphs"])
    assert opts.concurrency == [64] and opts.log_dir == "/x" and opts.cuda_graphs is False
    assert engine_ceiling.parse([]).cuda_graphs is True


def test_engine_ceiling_means_cover_the_measured_run_only() -> None:
    # a warm-up at 8 (64 steps of 8) before a run at 56 (100 steps): the run's mean is 56,
    # where the worker's running total says 27.9
    before = {"tokenyard_worker_batch_size": (512.0, 64.0)}
    after = {"tokenyard_worker_batch_size": (512.0 + 5600.0, 164.0)}
    assert engine_ceiling._run_mean(before, after, "tokenyard_worker_batch_size", 1.0) == 56.0
    assert engine_ceiling._run_mean(before, before, "tokenyard_worker_batch_size", 1.0) is None
    assert engine_ceiling._run_mean({}, after, "absent", 1e3) is None


def test_summary_table(tmp_path: Path, capsys: object) -> None:
    cell = {
        "transformers": {"tok_s": 1000.0},
        "engine": {"tok_s": 900.0, "mean_batch": 63.5},
        "http": {
            "tok_s": 850.0,
            "mean_batch": 60.1,
            "ttft_ms": {"p50": 20.0, "p99": 80.0},
            "errors": {},
        },
        "http_over_offline_max": 0.85,
        "engine_over_transformers": 0.9,
    }
    doc = {"device": "cuda", "dtype": "bfloat16", "prompt_words": 32, "max_tokens": 64}
    (tmp_path / "ceiling-c64.json").write_text(json.dumps({**doc, "results": {"64": cell}}))
    steps = tmp_path / "steps.tsv"
    steps.write_text("facts\t0\t3\t30\nceiling-c64\t0\t90\t200\nceiling-c256\t124\t200\t200\n")
    summary.main([str(tmp_path), str(steps)])
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["engine_ceiling"][0]["c"] == 64
    assert written["engine_ceiling"][0]["http_errors"] == 0
    assert [s["rc"] for s in written["steps"]] == ["0", "0", "124"]
    assert written["workload"] == doc


def test_run_script_is_valid_bash() -> None:
    script = REPO / "bench" / "gpu" / "run_device.sh"
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
