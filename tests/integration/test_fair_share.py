"""Fair share measured with real sim workers (bench/fair_share.py at a small size): a late
tenant waits behind a bounded number of a backlogged tenant's jobs, and under sustained
contention each tenant's share of generated tokens is within ±10 % of its weight's share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenyard.broker.redis.embedded import EmbeddedServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(valkey: EmbeddedServer) -> str:
    return valkey.url


def fair_share(url: str, scenario: str, *args: str) -> dict[str, Any]:
    """One scenario of `python -m bench.fair_share` (its own key prefix, fair window 4)."""
    run = subprocess.run(
        [sys.executable, "-m", "bench.fair_share", "--broker", url, "--only", scenario,
         "--fair-window", "4", "--workers", "1", "--slots", "8", *args],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    out: dict[str, Any] = json.loads(run.stdout)[scenario]
    return out


def test_a_late_tenant_waits_behind_a_bounded_part_of_a_backlog(url: str) -> None:
    out = fair_share(url, "backlog", "--backlog", "2000", "--late", "20")
    print(json.dumps(out))
    assert out["b_done"] == 20
    # bound: b's 20 + the window + what the worker holds (2 x 8 slots) of a's jobs
    assert out["a_jobs_done_while_b_waited"] <= out["bound_a_jobs"] == 20 + 4 + 16
    # in time: far from a's backlog (FIFO would make b wait for all 2,000 of a's jobs)
    assert out["b_wait_s"] < out["fifo_wait_s"] / 4


def test_token_shares_follow_weights_under_contention(url: str) -> None:
    out = fair_share(
        url, "contention", "--tenants", "a", "b", "c", "--weights", "1", "1", "3",
        "--sizes", "8", "32", "16", "--tokens", "4000",
    )  # fmt: skip
    print(json.dumps(out))
    for tenant, share in out["tenants"].items():
        assert abs(share["relative_error"]) <= 0.10, (tenant, share)
