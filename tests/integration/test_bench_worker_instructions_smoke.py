"""The worker-instructions benchmark counts a worker draining a few jobs under callgrind."""

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
def test_worker_instructions_benchmark_counts_the_jobs_between_two_fills() -> None:
    run = subprocess.run(
        [
            sys.executable, "-m", "bench.worker_instructions",
            "--jobs", "40", "--base", "10", "--max-seqs", "64",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["jobs"] == 40
    # 40 more jobs cost more than the start-up they share: a positive count per job, and a
    # plausible one (a job claimed, run and completed is ~10^5 instructions, not 10^3 or 10^8)
    assert 10_000 < report["instructions_per_job"]["64"] < 10_000_000
