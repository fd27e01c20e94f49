"""The queue-overhead benchmark runs end to end for tokenyard alone (no peers needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "queue_overhead.py"


@pytest.mark.timeout(90)
def test_queue_overhead_benchmark_completes_every_tokenyard_job() -> None:
    jobs = 200
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--jobs",
            str(jobs),
            "--latency-jobs",
            "30",
            "--systems",
            "tokenyard,tokenyard-broker",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=80,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)

    assert report["jobs"] == jobs and report["latency_jobs"] == 30
    assert set(report["systems"]) == {"tokenyard", "tokenyard-broker"}
    for name, row in report["systems"].items():
        assert "error" not in row, (name, row)
        assert row["completed"] == jobs and row["all_done"] is True, name
        assert row["jobs_per_s"] > 0 and row["enqueue_jobs_per_s"] > 0, name
        assert 0 < row["latency_p50_ms"] <= row["latency_p99_ms"], name
        assert row["server_commands_per_job"] > 0, name
        assert isinstance(row["settings"], dict) and row["settings"], name
    assert report["systems"]["tokenyard"]["settings"]["max_tokens"] == 1
    comparison = report["tokenyard_vs_best_peer"]
    assert comparison["goal"] == 3.0 and "best_peer" not in comparison  # no peers ran
