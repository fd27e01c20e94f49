"""bench/upstream_overhead.py runs end to end in its smoke mode: the mock upstream, tokenyard's
gateway + worker and `tokenyard serve` on the remote engine in front of it, every request
answered in full, the latency floor (the same hops, no tokenyard code) likewise, the remote
engine driven alone against the mock, and a LiteLLM that is not there reported as not
measured."""

from __future__ import annotations

import pytest

from tests.integration.test_bench_http_smoke import assert_summary, run_bench


@pytest.mark.timeout(240)
def test_upstream_overhead_quick_measures_each_target() -> None:
    requests = 10
    report = run_bench(
        "upstream_overhead", "--quick", "--requests", str(requests), "--warmup", "2",
        "--load-s", "1", "--concurrency", "16",
        "--targets", "direct,tokenyard,floor,tokenyard-serve,litellm",
        "--litellm", "/nonexistent/litellm", timeout=230,
    )  # fmt: skip

    assert report["benchmark"] == "upstream_overhead"
    assert report["config"]["litellm"].startswith("not measured")
    targets = ("direct", "tokenyard", "floor", "tokenyard-serve")
    assert set(report["latency"]) == set(report["load"]) == set(targets)
    for name in targets:
        latency, load = report["latency"][name], report["load"][name]
        assert latency["errors"] == {} and load["errors"] == {}, name
        assert_summary(latency["e2e_ms"], requests, f"{name} e2e")
        assert load["requests"] > 0 and load["req_per_s"] > 0, name
        assert load["cpu_ms_per_request"]["mock"] > 0, name  # its requests reached the mock
    for name in targets[1:]:
        assert_summary(report["latency"][name]["added_ms"], requests, f"{name} added")
    assert {"gateway", "worker", "valkey"} <= set(report["load"]["tokenyard"]["cpu_ms_per_request"])
    assert {"serve", "worker", "valkey"} <= set(
        report["load"]["tokenyard-serve"]["cpu_ms_per_request"]
    )
    # the floor: the same hops with no tokenyard code; what tokenyard adds beyond them
    assert {"gateway", "worker", "valkey"} <= set(report["load"]["floor"]["cpu_ms_per_request"])
    assert set(report["beyond_floor_ms"]) == {"tokenyard"}
    assert set(report["goals"]) == {"added_p50_ms", "added_p99_ms", "req_per_s"}
    # the remote engine driven alone against the mock
    alone = report["remote_engine_alone"]
    assert alone["one_at_a_time"]["errors"] == 0 == alone["in_flight"]["errors"]
    assert_summary(alone["one_at_a_time"]["e2e_ms"], requests, "engine alone e2e")
    assert alone["in_flight"]["requests"] > 0
    assert alone["in_flight"]["cpu_ms_per_request"]["mock"] > 0
