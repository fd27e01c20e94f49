"""The prefix affinity benchmark runs end to end at small sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = "bench.prefix_affinity"


@pytest.mark.timeout(120)
def test_prefix_affinity_benchmark_reports_both_runs() -> None:
    run = subprocess.run(
        [sys.executable, "-m", BENCH, "--quick", "--jobs", "30"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    for key in ("without_affinity", "with_affinity"):
        result = report[key]
        assert result["succeeded"] == result["jobs"] == 30
        assert result["ttft"]["p50_ms"] is not None
    # figures are reported, not asserted (a loaded machine); the hit rate is not timing
    assert (
        report["with_affinity"]["prefix_cache_hit_rate"]
        > report["without_affinity"]["prefix_cache_hit_rate"]
    )
