"""The batch-vs-interactive benchmark runs end to end in its smoke mode."""

from __future__ import annotations

import pytest

from tests.integration.test_bench_http_smoke import run_bench


@pytest.mark.timeout(120)
def test_batch_interactive_quick_reports_both_latencies() -> None:
    report = run_bench("batch_interactive", "--quick", timeout=110)
    assert report["batch"]["status"] == "completed"
    assert report["batch"]["requests"] == {"total": 300, "completed": 300, "failed": 0}
    for phase in ("interactive_idle_s", "interactive_during_batch_s"):
        assert report[phase]["count"] > 0 and report[phase]["p99"] is not None
    assert report["p99_ratio"] is not None
