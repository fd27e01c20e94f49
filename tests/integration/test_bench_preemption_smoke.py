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


@pytest.mark.timeout(120)
def test_preemption_what_ifs_run_and_stages_name_the_slowest_jobs() -> None:
    report = run_bench(
        "preemption",
        "--quick",
        "--stages",
        "--split",
        "2",
        "--cut-in",
        "--gap-jitter-s",
        "0.01",
        timeout=110,
    )
    loaded = report["loaded_with_preemption"]
    assert loaded["ttft_s"]["count"] == 10 and loaded["preemptions"] > 0
    (stages,) = loaded["stages_ms"]  # --quick: one round
    assert stages["jobs"] == 10 and len(stages["slowest"]) == 3
    # every high job's path was marked, stage by stage, the slowest first
    totals = [sum(v for k, v in job.items() if k != "in_flight") for job in stages["slowest"]]
    assert totals == sorted(totals, reverse=True) and totals[0] > 0
    # and what the engine ran as each was added: a sleep of the loaded engine's, or none
    in_flight = {k: v for k, v in stages["in_flight"].items() if k != "what"}
    assert sum(kind["jobs"] for kind in in_flight.values()) == 10
    assert all(k == "none" or k == "prefill" or k.startswith("decode ") for k in in_flight)
    assert all(job["in_flight"] in in_flight for job in stages["slowest"])
