"""`python -m bench.vllm_engines` runs end to end in its smoke mode: every target and ratio."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_vllm_engines_quick() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.vllm_engines", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=880,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(run.stdout)
    results = report["results"]
    assert set(results) == {"vllm-serve", "tokenyard-remote", "tokenyard-vllm", "tokenyard-hf"}
    for target, result in results.items():
        for level in ("concurrent", "one_at_a_time", "open_rate"):
            cell = result[level]
            assert not cell["errors"], (target, level, cell["error_examples"])
            assert cell["throughput"]["output_tokens_per_s"] > 0, (target, level)
            assert cell["sse_events_per_request"]["count"] > 0, (target, level)
    assert set(report["ratios"]) == {
        "tokenyard-vllm / vllm-serve",
        "tokenyard-remote / vllm-serve",
        "tokenyard-hf / tokenyard-vllm",
    }
    assert "open_rate_tpot_p99" in report["ratios"]["tokenyard-vllm / vllm-serve"]
