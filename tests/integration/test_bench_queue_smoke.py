"""The queue-overhead benchmark runs end to end for tokenyard alone (no peers needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = "bench.queue_overhead"


@pytest.mark.timeout(170)
def test_queue_overhead_benchmark_completes_every_tokenyard_job() -> None:
    jobs, http_jobs = 200, 40
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            BENCH,
            "--jobs",
            str(jobs),
            "--http-jobs",
            str(http_jobs),
            "--latency-jobs",
            "20",
            "--tokens-per-job",
            "4",
            "--systems",
            "tokenyard,tokenyard-broker,tokenyard-http",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=160,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)

    assert report["jobs"] == jobs and report["latency_jobs"] == 20 and report["in_flight"] == 64
    assert set(report["systems"]) == {"tokenyard", "tokenyard-broker", "tokenyard-http"}
    for name in ("tokenyard", "tokenyard-broker"):
        row = report["systems"][name]
        assert "error" not in row and row["all_done"] is True, (name, row)
        for mode in ("one_at_a_time", "in_flight", "enqueue_many"):  # single-job, then batched
            cell = row[mode]
            assert cell["completed"] == jobs and cell["all_done"] is True, (name, mode)
            assert cell["jobs_per_s"] > 0 and cell["enqueue_jobs_per_s"] > 0, (name, mode)
            assert cell["server_commands_per_job"] > 0, (name, mode)
        assert 0 < row["latency"]["p50_ms"] <= row["latency"]["p99_ms"], name
        assert isinstance(row["settings"], dict) and row["settings"], name
    assert report["systems"]["tokenyard"]["settings"]["max_tokens"] == 1

    http = report["systems"]["tokenyard-http"]
    assert "error" not in http and http["all_done"] is True, http
    for mode in ("jobs_one_at_a_time", "jobs_in_flight"):
        assert http[mode]["completed"] == http_jobs and http[mode]["jobs_per_s"] > 0, mode
    for mode in ("completions_one_at_a_time", "completions_in_flight"):
        assert http[mode]["jobs_per_s"] > 0 and http[mode]["server_commands_per_job"] > 0, mode
    assert http["tokens"]["tokens"] == http["tokens"]["requests"] * 4
    assert http["tokens"]["server_commands_per_token"] > 0
    assert 0 < http["latency"]["p50_ms"] <= http["latency"]["p99_ms"]

    comparison = report["tokenyard_vs_best_peer"]
    assert comparison["goal"] == 3.0 and "one_at_a_time" not in comparison  # no peers ran
