"""The overload benchmark runs end to end in its smoke mode (shedding only)."""

from __future__ import annotations

import pytest

from tests.integration.test_bench_http_smoke import run_bench


@pytest.mark.timeout(120)
def test_overload_quick_reports_admitted_refused_and_memory() -> None:
    report = run_bench("overload", "--quick", "--no-compare", timeout=110)
    shed = report["shedding"]
    assert shed["server_errors_5xx"] == 0 and not shed["other"]
    assert shed["admitted"] > 0 and shed["refused_429"] > 0
    assert shed["refused_429_with_retry_after_and_openai_body"] == shed["refused_429"]
    assert shed["admitted"] + shed["refused_429"] == shed["requests"]
    assert shed["admitted_latency_ms"]["p99"] is not None
    # every admitted job's record was read for its queue wait
    assert shed["admitted_queue_wait_ms"]["jobs"] == shed["admitted"]
    assert shed["admitted_queue_wait_ms"]["p99"] is not None
    assert shed["gateway_rss_mb"]["peak"] is not None
    assert "without_shedding" not in report
