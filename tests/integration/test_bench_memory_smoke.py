"""The broker memory benchmark runs end to end on a small job count: a finished job weighs
more than a waiting one, and a longer prompt more than a short one."""

from __future__ import annotations

import pytest

from tests.integration.test_bench_http_smoke import run_bench


@pytest.mark.timeout(120)
def test_broker_memory_benchmark_reports_bytes_per_job() -> None:
    report = run_bench("broker_memory", "--jobs", "500", timeout=110)
    assert report["jobs"] == 500 and report["prompt_tokens"] == 512
    # 512 prompt token ids alone are over 1 kB of msgpack
    assert 1000 < report["bytes_per_waiting_job"] < report["bytes_per_finished_job"]
