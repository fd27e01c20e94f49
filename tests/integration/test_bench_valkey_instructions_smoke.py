"""The Valkey-instructions benchmark counts a few one-job cycles under callgrind."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("valgrind") is None, reason="needs valgrind")
def test_valkey_instructions_benchmark_counts_the_measured_cycles() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.valkey_instructions", "--jobs", "5", "--warmup", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["jobs"] == 5
    # the measured cycles ran the three scripts each: enqueue, claim, complete
    assert report["commands_per_job_by_name"]["evalsha"] >= 3
    assert report["instructions_per_job"] > 0
    assert 0 < report["share"]["scripts"] < 1
