"""Fair share measured with real sim workers (bench/fair_share.py at a small size): a late
tenant waits behind a bounded number of a backlogged tenant's jobs, and under sustained
contention each tenant's share of generated tokens is within ±10 % of its weight's share."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from bench import fair_share
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.config import BrokerSettings


@pytest.fixture
def url(valkey: EmbeddedServer) -> str:
    return valkey.url


def settings(url: str) -> BrokerSettings:
    return BrokerSettings(url=url, prefix=f"fs{uuid.uuid4().hex[:6]}", fair_window=4)


def test_a_late_tenant_waits_behind_a_bounded_part_of_a_backlog(url: str) -> None:
    out = asyncio.run(fair_share.backlog(settings(url), 2000, 20, workers=1, slots=8))
    print(json.dumps(out))
    assert out["b_done"] == 20
    # bound: b's 20 + the window + what the worker holds (2 x 8 slots) of a's jobs
    assert out["a_jobs_done_while_b_waited"] <= out["bound_a_jobs"] == 20 + 4 + 16
    # in time: far from a's backlog (FIFO would make b wait for all 2,000 of a's jobs)
    assert out["b_wait_s"] < out["fifo_wait_s"] / 4


def test_token_shares_follow_weights_under_contention(url: str) -> None:
    out = asyncio.run(
        fair_share.contention(
            settings(url),
            weights={"a": 1.0, "b": 1.0, "c": 3.0},
            sizes={"a": 8, "b": 32, "c": 16},
            tokens=4000,
            workers=1,
            slots=8,
        )
    )
    print(json.dumps(out))
    for tenant, share in out["tenants"].items():
        assert abs(share["relative_error"]) <= 0.10, (tenant, share)
