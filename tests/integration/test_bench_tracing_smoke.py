"""`python -m bench.tracing_overhead` runs end to end in its smoke mode and reports every field."""

from __future__ import annotations

import pytest

from tests.integration.test_bench_http_smoke import run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_tracing_overhead_quick_reports_hooks_and_light_load() -> None:
    report = run_bench("tracing_overhead", "--quick", timeout=110)
    hooks = report["hooks"]
    assert hooks["jobs"] == 500
    assert hooks["off_us_per_job"] < hooks["on_us_per_job"]
    light = report["light_load"]
    for mode in ("off", "on"):
        assert light[mode]["requests"] == 10
        assert 0 < light[mode]["median_ms"] <= light[mode]["p99_ms"]
    assert isinstance(light["median_overhead_ms"], float)
