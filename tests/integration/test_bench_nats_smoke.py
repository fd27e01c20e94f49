"""bench.nats_vs_valkey runs end to end on both brokers at tiny sizes (plain nats-py too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(200)
def test_nats_vs_valkey_benchmark_reports_every_cell() -> None:
    jobs, requests = 60, 12
    argv = ["--jobs", str(jobs), "--latency-jobs", "5", "--http-requests", str(requests),
            "--in-flight", "8", "--tokens", "3"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "bench.nats_vs_valkey", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=190,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)

    assert report["all_done"] is True and report["config"]["jobs"] == jobs
    assert set(report["servers"]) == {"valkey", "nats"}
    assert set(report["queue"]["valkey"]) == {"tokenyard-broker"}
    assert set(report["queue"]["nats"]) == {"tokenyard-broker", "nats-py"}
    for broker, systems in report["queue"].items():
        for system, row in systems.items():
            for mode in ("one_at_a_time", "in_flight"):
                cell = row[mode]
                assert cell["completed"] == jobs and cell["all_done"] is True, (broker, system)
                assert cell["jobs_per_s"] > 0 and cell["enqueue_jobs_per_s"] > 0
            assert 0 < row["latency"]["p50_ms"] <= row["latency"]["p99_ms"], (broker, system)
    for mode in ("one_at_a_time", "in_flight"):
        assert report["queue"]["valkey"]["tokenyard-broker"][mode]["server_round_trips_per_job"] > 0
        for system in ("tokenyard-broker", "nats-py"):
            cell = report["queue"]["nats"][system][mode]
            # every enqueue is at least one JetStream publish, every job at least one ack
            assert cell["producer_msgs_per_job"] >= 1.0, (system, mode)
            assert cell["consumer_msgs_per_job"] >= 1.0, (system, mode)
    for broker in ("valkey", "nats"):
        http = report["http"][broker]
        assert "error" not in http, http
        for mode in ("sync_one_at_a_time", "sync_in_flight", "stream_one_at_a_time",
                     "stream_in_flight"):  # fmt: skip
            cell = http[mode]
            assert cell["completed"] == requests and cell["requests_per_s"] > 0, (broker, mode)
            assert 0 < cell["e2e_p50_ms"] <= cell["e2e_p99_ms"], (broker, mode)
        assert http["stream_one_at_a_time"]["ttft_p50_ms"] > 0
    ratios = report["ratios"]
    assert set(ratios["tokenyard_nats_over_valkey"]) == {"one_at_a_time", "in_flight"}
    plain = ratios["tokenyard_nats_over_plain_nats_py"]
    assert plain["goal"] == 0.8 and isinstance(plain["met"], bool)
    assert plain["one_at_a_time"] > 0 and plain["in_flight"] > 0
    assert all(v > 0 for v in ratios["http_nats_over_valkey"].values())
