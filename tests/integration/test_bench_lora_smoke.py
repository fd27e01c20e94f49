"""The LoRA mix benchmark runs end to end in --quick mode: every token of every run comes
back, and its mixed runs put all four adapters in one engine pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_lora_mix_benchmark_quick_reports_both_workloads() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.lora_mix", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    report = json.loads(run.stdout)
    assert report["bench"] == "lora_mix" and report["adapters"] == 4
    expected = report["requests_per_run"] * report["max_tokens"]
    for name in ("base", "mixed"):
        assert [r["tokens"] for r in report["runs"][name]] == [expected]
        assert report["median_tokens_per_s"][name] > 0
    assert report["most_adapters_in_one_pass"] == 4
    assert report["mixed_over_base"] > 0 and report["mixed_over_base_per_cpu_s"] > 0
