"""The broker memory benchmark runs end to end on a small job count: a finished job weighs
more than a waiting one, and a longer prompt more than a short one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_broker_memory_benchmark_reports_bytes_per_job() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.broker_memory", "--jobs", "500"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["jobs"] == 500 and report["prompt_tokens"] == 512
    # 512 prompt token ids alone are over 1 kB of msgpack
    assert 1000 < report["bytes_per_waiting_job"] < report["bytes_per_finished_job"]
