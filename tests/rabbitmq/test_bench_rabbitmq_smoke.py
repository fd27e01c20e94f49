"""bench.rabbitmq_vs_valkey runs end to end on both brokers at tiny sizes (plain aio-pika too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
QUEUE_MODES = ("one_at_a_time", "in_flight")
HTTP_MODES = ("sync_one_at_a_time", "sync_in_flight", "stream_one_at_a_time", "stream_in_flight")


@pytest.mark.timeout(300)
def test_rabbitmq_vs_valkey_benchmark_reports_every_cell() -> None:
    jobs, requests = 60, 12
    argv = ["--jobs", str(jobs), "--latency-jobs", "5", "--http-requests", str(requests),
            "--in-flight", "8", "--tokens", "3"]  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "bench.rabbitmq_vs_valkey", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=290,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)

    assert report["benchmark"] == "rabbitmq_vs_valkey"
    assert report["all_done"] is True and report["config"]["jobs"] == jobs
    assert set(report["servers"]) == {"valkey", "rabbitmq"}
    assert report["servers"]["rabbitmq"].startswith("rabbitmq ")
    assert set(report["queue"]["valkey"]) == {"tokenyard-broker"}
    assert set(report["queue"]["rabbitmq"]) == {"tokenyard-broker", "aio-pika"}
    for broker, systems in report["queue"].items():
        for system, row in systems.items():
            for mode in QUEUE_MODES:
                cell = row[mode]
                assert cell["completed"] == jobs and cell["all_done"] is True, (broker, system)
                assert cell["jobs_per_s"] > 0 and cell["enqueue_jobs_per_s"] > 0
                assert cell["server_cpu_us_per_job"] >= 0, (broker, system, mode)
            assert 0 < row["latency"]["p50_ms"] <= row["latency"]["p99_ms"], (broker, system)
    for mode in QUEUE_MODES:
        assert report["queue"]["valkey"]["tokenyard-broker"][mode]["server_round_trips_per_job"] > 0
        ours = report["queue"]["rabbitmq"]["tokenyard-broker"][mode]
        # records, leases and events live in the tables' Valkey; the lanes in RabbitMQ
        assert ours["tables_commands_per_job"] > 0 and ours["tables_round_trips_per_job"] > 0
        assert ours["tables_cpu_us_per_job"] >= 0
        for system in ("tokenyard-broker", "aio-pika"):
            cell = report["queue"]["rabbitmq"][system][mode]
            # the node reads and writes for every job, though one socket write may carry
            # several pushed deliveries (a consumer's prefetch)
            assert cell["server_socket_reads_per_job"] > 0, (system, mode)
            assert cell["server_socket_writes_per_job"] > 0, (system, mode)
    for broker in ("valkey", "rabbitmq"):
        http = report["http"][broker]
        assert "error" not in http, http
        for mode in HTTP_MODES:
            cell = http[mode]
            assert cell["completed"] == requests and cell["requests_per_s"] > 0, (broker, mode)
            assert 0 < cell["e2e_p50_ms"] <= cell["e2e_p99_ms"], (broker, mode)
        assert http["stream_one_at_a_time"]["ttft_p50_ms"] > 0
    assert "tables_commands_per_request" in report["http"]["rabbitmq"]["sync_one_at_a_time"]
    ratios = report["ratios"]
    assert set(ratios["tokenyard_rabbitmq_over_valkey"]) == set(QUEUE_MODES)
    plain = ratios["tokenyard_rabbitmq_over_plain_aio_pika"]
    assert plain["one_at_a_time"] > 0 and plain["in_flight"] > 0
    assert plain["latency_p50 (plain/tokenyard)"] > 0
    assert set(ratios["http_rabbitmq_over_valkey"]) == set(HTTP_MODES)
    assert all(v > 0 for v in ratios["http_rabbitmq_over_valkey"].values())
