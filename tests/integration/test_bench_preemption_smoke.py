"""The preemption benchmark runs end to end in its smoke mode (speed is reported, not asserted)."""

from __future__ import annotations

import pytest

from tests.integration.test_bench_http_smoke import run_bench


@pytest.mark.timeout(120)
def test_preemption_quick_reports_ttft_and_throughput_of_each_run() -> None:
    report = run_bench("preemption", "--quick", timeout=110)
    for phase in ("idle", "loaded_with_preemption", "loaded_without_preemption"):
        assert report[phase]["ttft_s"]["count"] == 10 and report[phase]["ttft_s"]["p99"]
        assert report[phase]["tokens_per_s"] > 0
    assert report["loaded_with_preemption"]["preemptions"] > 0
    assert report["loaded_without_preemption"]["preemptions"] == 0
    assert report["ttft_p99_ratio_loaded_vs_idle"] and report["tokens_per_s_ratio_vs_without"]
