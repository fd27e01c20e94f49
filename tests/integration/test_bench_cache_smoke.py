"""The cache, collapsing and size pools benchmark runs end to end at small sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = "bench.cache_pools"


@pytest.mark.timeout(120)
def test_cache_pools_benchmark_reports_one_job_hits_and_pools() -> None:
    run = subprocess.run(
        [sys.executable, "-m", BENCH, "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    collapse = report["collapse"]
    assert collapse["engine_jobs"] == 1 and collapse["distinct_answers"] == 1
    assert collapse["verdicts"].get("miss") == 1
    assert report["latency"]["hit_verdicts"] == ["hit"]
    assert report["latency"]["hit"]["p50_ms"] < report["latency"]["miss"]["p50_ms"]
    with_pools, one_pool = report["pools"]["with_pools"], report["pools"]["one_pool"]
    assert with_pools["failed"] == 0  # no long job reached the short worker
    # without pools the short worker may claim long jobs it cannot hold (a race: reported only)
    assert one_pool["succeeded"] + one_pool["failed"] == one_pool["jobs"]
