"""The engine batching benchmark runs end to end in --quick mode and reports every field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
BENCH = "bench.engine_batching"
MODES = ("one-at-a-time", "static", "continuous")
PATHS = ("direct", "queue")


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_engine_batching_benchmark_quick_completes_every_request() -> None:
    run = subprocess.run(
        [sys.executable, "-m", BENCH, "--quick", "--concurrency", "1,4", "--requests", "8"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(run.stdout)

    assert report["benchmark"] == "engine_batching"
    assert report["all_completed"] is True
    assert report["config"]["concurrency"] == [1, 4]
    assert report["config"]["torch_threads"] >= 1
    max_tokens = report["config"]["max_tokens"]
    assert set(report["results"]) == set(MODES)
    for mode in MODES:
        assert set(report["results"][mode]) == set(PATHS), mode
        for path in PATHS:
            for level in ("1", "4"):
                cell = report["results"][mode][path][level]
                where = f"{mode}/{path}/{level}"
                assert cell["concurrency"] == int(level), where
                assert cell["requests"] == cell["completed"] == 8, where
                assert cell["errors"] == 0, where
                assert cell["output_tokens"] == 8 * max_tokens, where
                assert cell["tokens_per_s"] > 0 and cell["requests_per_s"] > 0, where
                for name in ("latency_ms", "ttft_ms"):
                    p50, p99 = cell[name]["p50"], cell[name]["p99"]
                    assert 0 < p50 <= p99, (where, name)
                assert cell["ttft_ms"]["p50"] <= cell["latency_ms"]["p50"], where
                assert cell["mean_batch"] >= 1.0, where
                if mode == "one-at-a-time":
                    assert cell["mean_batch"] == 1.0, where
        calls = report["results"][mode]["queue"]["4"]["worker_broker"]
        assert calls["append_events"]["calls"] >= 1, mode
        # eight jobs finish: one completion call each, or fewer when the worker batches them
        assert 1 <= calls["complete_many"]["calls"] <= 8, mode

    ratios = report["ratios"]
    assert ratios["target_continuous_queue_over_direct"] == 0.9
    for level in ("1", "4"):
        assert ratios["continuous_queue_over_direct"][level] > 0
        assert isinstance(ratios["meets_target"][level], bool)
        for key in (
            "continuous_over_static",
            "continuous_over_one_at_a_time",
            "static_over_one_at_a_time",
        ):
            for path in PATHS:
                assert ratios[key][path][level] > 0, (key, path, level)
