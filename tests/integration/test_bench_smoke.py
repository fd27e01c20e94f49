"""The broker throughput benchmark runs end to end on a tiny job count and reports every field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = "bench.broker_throughput"


@pytest.mark.timeout(120)
def test_broker_throughput_benchmark_completes_every_job() -> None:
    jobs = 500
    run = subprocess.run(
        [sys.executable, "-m", BENCH, "--jobs", str(jobs), "--slots", "64", "--batch", "100"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)

    assert report["jobs"] == jobs and report["slots"] == 64 and report["batch"] == 100
    assert report["completed"] == jobs and report["all_completed"] is True
    for rate in ("cycle_jobs_per_s", "enqueue_only_jobs_per_s", "enqueue_in_cycle_jobs_per_s"):
        assert report[rate] > 0, rate
    assert report["cycle_wall_s"] > 0
    # every job takes at least an enqueue and a complete script, plus what they run inside
    assert 0 < report["script_calls_per_job"] <= 2.0
    assert report["commands_per_job"] > report["script_calls_per_job"]
    by_name = report["commands_per_job_by_name"]
    assert {"evalsha", "xadd", "xreadgroup", "xack"} <= set(by_name)
    assert set(report["cpu_us_per_job"]) == {"producer", "consumer", "server"}
    assert report["target_jobs_per_s"] == 10_000 and isinstance(report["meets_target"], bool)
