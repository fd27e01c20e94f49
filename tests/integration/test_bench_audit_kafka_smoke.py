"""`python -m bench.audit_kafka` runs end to end in its smoke mode and reports every field."""

from __future__ import annotations

import pytest

from tests.integration.test_bench_http_smoke import run_bench

pytestmark = [pytest.mark.slow, pytest.mark.kafka]  # `make test-brokers`


@pytest.mark.timeout(120)
def test_audit_kafka_quick_reports_both_modes_and_ratios() -> None:
    report = run_bench("audit_kafka", "--quick", timeout=110)
    assert (report["jobs"], report["rounds"], report["entries_per_job"]) == (300, 1, 2)
    for mode in ("off", "on"):
        assert report[mode]["wall_us_per_job"] > 0 and report[mode]["cpu_us_per_job"] > 0
    # every entry of the on run reached Kafka, none was dropped
    assert (report["on"]["sent"], report["on"]["dropped"]) == (600, 0)
    assert report["on_over_off_wall"] > 0 and report["on_over_off_cpu"] > 0
    assert isinstance(report["added_cpu_us_per_job"], float)
