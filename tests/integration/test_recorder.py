"""The dashboard's recorder on a real broker with an injected clock: two gateways record every
5 s into the series table; the charts made of their points add up each gateway's answers and
tenants' use, count the fleet's lanes once, and show the budget left in the quota table."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import BackendFactory
from tokenyard.broker import new_job_id
from tokenyard.gateway.charts import Point, chart
from tokenyard.gateway.recorder import Recorder, Usage
from tokenyard.messages import JobSpec, Priority, SamplingParams, decode
from tokenyard.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, GatewayMetrics
from tokenyard.tenancy.limiter import Quota

pytestmark = pytest.mark.parametrize("make_backend", ["valkey", "nats"], indirect=True)
MODEL = "rec-model"
QUOTA = Quota(token_budget=1000, budget_period="day")


def job() -> JobSpec:
    return JobSpec(
        id=new_job_id(MODEL),
        model=MODEL,
        tenant="acme",
        priority=Priority.NORMAL,
        prompt="hello",
        sampling=SamplingParams(max_tokens=4),
    )


async def test_two_gateways_points_chart_the_fleet_once_and_their_traffic_summed(
    make_backend: BackendFactory,
) -> None:
    now = [1_750_000_000.0]  # a fixed moment, moved by hand

    def clock() -> float:
        return now[0]

    gateways = []
    for name in ("gw-1", "gw-2"):
        backend = make_backend(clock=clock)  # one broker, a client each
        metrics, usage = GatewayMetrics(), Usage()
        recorder = Recorder(backend, metrics, usage, lambda: [MODEL], name, 5.0, clock=clock)
        gateways.append((backend, metrics, usage, recorder))
    backend = gateways[0][0]
    for _ in range(3):
        await backend.queue.enqueue(job())  # no worker: they wait
    # 300 tokens of the tenant's budget reserved through some gateway
    [admitted] = await backend.quotas.reserve("acme", QUOTA, [("j-1", 300)])
    assert admitted.admitted
    for _ in range(5):
        for i, (_, metrics, usage, _) in enumerate(gateways):
            route = metrics.requests.labels
            route("POST", "/v1/chat/completions", "200").inc(10 * (i + 1))
            route("POST", "/v1/chat/completions", "429").inc()
            route("POST", "/v1/completions", "400").inc(i)
            route("POST", "/v1/jobs", "503").inc(2)
            route("GET", "/dashboard/data", "200").inc(50)  # the dashboard's polls: no traffic
            for _ in range(3):
                usage.asked("acme", QUOTA)
            usage.refused("acme")
            usage.used("acme", 40)
        await asyncio.gather(*(recorder.record() for *_, recorder in gateways))
        now[0] += 5.0
    recorded = await gateways[1][0].series.since(0.0)
    assert sorted({s for s, _, _ in recorded}) == ["gw-1", "gw-2"] and len(recorded) == 10
    points = [(s, decode(v, Point)) for s, _, v in recorded]
    drawn = chart(points, 0.0, 5.0, TTFT_BUCKETS, REQUEST_LATENCY_BUCKETS)
    assert [p["t"] for p in drawn["answers"]] == [1_750_000_000.0 + 5 * i for i in range(5)]
    assert drawn["answers"][0]["2xx"] is None  # one point per gateway: no rate yet
    last = drawn["answers"][-1]
    # per second, both gateways: (10 + 20) / 5 answered, 2 / 5 refused, 1 / 5 bad, 4 / 5 failed
    assert last["2xx"] == pytest.approx(6.0) and last["429"] == pytest.approx(0.4)
    assert last["4xx"] == pytest.approx(0.2) and last["5xx"] == pytest.approx(0.8)
    lanes = drawn["models"][MODEL][-1]
    assert lanes["waiting"]["normal"] == 3 and lanes["workers"] == 0  # one fleet, seen twice
    acme = drawn["tenants"]["acme"][-1]
    assert acme["requests_per_s"] == pytest.approx(1.2) and acme["refused_per_s"] == pytest.approx(
        0.4
    )
    assert acme["tokens_per_s"] == pytest.approx(16.0)
    assert acme["budget_left"] == 700  # the quota table's, fleet-wide


async def test_a_recorder_records_on_its_own_until_closed(make_backend: BackendFactory) -> None:
    backend = make_backend()
    waits: list[float] = []

    async def sleep(seconds: float) -> None:  # the recorder's pause, counted, not waited
        waits.append(seconds)
        await asyncio.sleep(0)

    recorder = Recorder(backend, GatewayMetrics(), Usage(), lambda: [MODEL], "gw", 2.0, sleep=sleep)
    recorder.start()
    while len(waits) < 3:
        await asyncio.sleep(0.01)
    await recorder.close()
    recorded = await backend.series.since(0.0)
    assert len(recorded) >= 3 and set(waits) == {2.0}
    off = Recorder(backend, GatewayMetrics(), Usage(), lambda: [MODEL], "off", 0.0)
    off.start()  # interval 0: this gateway records nothing
    await off.close()
    assert {s for s, _, _ in await backend.series.since(0.0)} == {"gw"}
