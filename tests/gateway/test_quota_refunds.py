"""No error path holds a quota: each path after a reservation gives it back at once, once.

One tenant may hold one job at a time (`max_concurrent=1`), with a tokens-per-minute limit and
a token budget; after each failure, over real HTTP against a real gateway and Valkey, the
tenant's next request is admitted at once and the broker's counters are exact. Stacks without
a worker run no quota sweep (workers run it), so nothing here is released by the sweep.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.gateway.conftest import MODEL, Stack, fast_engine, run_stack, slow_engine
from tests.netfault import Relay
from tokenyard.broker.redis import scripts
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.messages import Priority
from tokenyard.tenancy.limiter import Quota

TENANT = "solo"
KEY = {"Authorization": "Bearer sk-solo"}
OTHER = {"Authorization": "Bearer sk-other"}
# six requests a minute: a request still counted leaves the limiter 10 s ahead of now
QUOTA = Quota(max_concurrent=1, rpm=6, tpm=100_000, token_budget=1_000_000)
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "temperature": 0.0}


def keyring() -> KeyRing:
    solo = Tenant(TENANT, Priority.NORMAL, quota=QUOTA)
    pair = Tenant("pair", Priority.NORMAL, quota=Quota(max_concurrent=2))
    return KeyRing({"sk-solo": solo, "sk-other": Tenant("other"), "sk-pair": pair})


def held(stack: Stack, url: str, tenant: str = TENANT) -> dict[str, Any]:
    """The tenant's quota counters and its held reservations, as the broker has them."""
    keys = stack.gateway_broker.queue.keys
    with redis.Redis.from_url(url, decode_responses=True) as r:
        counters = r.hgetall(keys.quota(tenant))
        return {
            "active": int(counters.get("active", 0)),
            "budget_used": int(counters.get("budget_used", 0)),
            "tpm_tat": float(counters.get("tpm_tat", 0)),
            "rpm_tat": float(counters.get("rpm_tat", 0)),
            "held": r.hkeys(keys.quota_held(tenant)),
        }


def assert_nothing_held(stack: Stack, url: str, *, request_back: bool) -> None:
    """Slot free, no reservation held, budget and tokens-per-minute all given back, and with
    `request_back` (the job never entered) the request too."""
    state = held(stack, url)
    assert state["active"] == 0 and state["held"] == [] and state["budget_used"] == 0, state
    # GCRA: a theoretical arrival time not past now means nothing is still counted
    assert state["tpm_tat"] <= time.time(), state
    assert (state["rpm_tat"] <= time.time()) == request_back, state


def next_is_admitted(http: httpx.Client) -> None:
    """The tenant's next request is admitted (202: queued; no worker needed)."""
    answer = http.post("/v1/jobs", json=BODY, headers=KEY)
    assert answer.status_code == 202, answer.text


def until(check: Any, within_s: float = 5.0) -> float:
    """Seconds until `check()` holds; fails past `within_s`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within_s, "never held"
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.fixture
def bare(valkey: EmbeddedServer) -> Iterator[Stack]:
    """A gateway with no worker: jobs stay queued, and no quota sweep runs."""
    with run_stack(valkey, engines=[], keyring=keyring()) as stack:
        yield stack


def test_enqueue_refused_by_the_broker_answers_500_and_refunds(
    bare: Stack, valkey: EmbeddedServer
) -> None:
    # the lane's key holds a string (a broken server state): the enqueue script errors
    # (WRONGTYPE) after the reservation was made
    lane = bare.gateway_broker.queue.keys.lane(MODEL, Priority.NORMAL, 0)
    with redis.Redis.from_url(valkey.url) as r:
        r.set(lane, "not a stream")
    with bare.client() as http:
        for path in ("/v1/completions", "/v1/jobs"):
            answer = http.post(path, json=BODY, headers=KEY)
            assert answer.status_code == 500, answer.text
            assert answer.json()["error"]["type"] == "server_error"
            assert_nothing_held(bare, valkey.url, request_back=True)
        with redis.Redis.from_url(valkey.url) as r:
            r.delete(lane)
        next_is_admitted(http)


def test_job_that_cannot_be_encoded_answers_400_and_refunds(
    bare: Stack, valkey: EmbeddedServer
) -> None:
    # a seed past 64 bits passes the request's parsing but not the queue's encoding, which
    # comes after the reservation
    with bare.client() as http:
        for path in ("/v1/completions", "/v1/jobs"):
            answer = http.post(path, json={**BODY, "seed": 2**64 + 1}, headers=KEY)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "invalid_value"
            assert_nothing_held(bare, valkey.url, request_back=True)
        next_is_admitted(http)


def test_full_lane_answers_429_and_refunds(valkey: EmbeddedServer) -> None:
    full = {"max_queue_depth": 1}
    with (
        run_stack(valkey, engines=[], keyring=keyring(), broker_options=full) as stack,
        stack.client() as http,
    ):
        # another tenant fills the lane
        assert http.post("/v1/jobs", json=BODY, headers=OTHER).status_code == 202
        answer = http.post("/v1/jobs", json=BODY, headers=KEY)
        assert answer.status_code == 429, answer.text
        assert answer.json()["error"]["code"] == "queue_full"
        assert_nothing_held(stack, valkey.url, request_back=True)


def test_replayed_request_holds_nothing_of_its_own(bare: Stack, valkey: EmbeddedServer) -> None:
    with bare.client() as http:
        headers = {"Authorization": "Bearer sk-pair", "Idempotency-Key": "once"}
        first = http.post("/v1/jobs", json=BODY, headers=headers)
        assert first.status_code == 202, first.text
        before = held(bare, valkey.url, "pair")
        again = http.post("/v1/jobs", json=BODY, headers=headers)
        assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
        # the replay reserved, found the job its key names, and gave its reservation back
        assert held(bare, valkey.url, "pair") == before
        assert before["active"] == 1 and before["held"] == [first.json()["id"]]


def test_cancelled_job_frees_its_slot_in_the_same_call(bare: Stack, valkey: EmbeddedServer) -> None:
    with bare.client() as http:
        job = http.post("/v1/jobs", json=BODY, headers=KEY).json()
        refused = http.post("/v1/jobs", json=BODY, headers=KEY)
        assert refused.status_code == 429  # the one slot is held
        assert http.delete(f"/v1/jobs/{job['id']}", headers=KEY).status_code == 200
        assert_nothing_held(bare, valkey.url, request_back=False)
        next_is_admitted(http)


def test_client_leaving_a_queued_call_frees_its_slot(bare: Stack, valkey: EmbeddedServer) -> None:
    for stream in (False, True):
        body = {**BODY, "stream": stream}
        # no worker: the job waits in its lane until the caller leaves (its read times out)
        with (
            contextlib.suppress(httpx.ReadTimeout),
            bare.client(timeout=0.5) as http,
            http.stream("POST", "/v1/completions", json=body, headers=KEY) as answer,
        ):
            for _ in answer.iter_bytes():
                pass
        until(lambda: held(bare, valkey.url)["active"] == 0)
        assert_nothing_held(bare, valkey.url, request_back=False)


def test_failed_job_answers_500_and_the_next_call_is_admitted_at_once(
    valkey: EmbeddedServer,
) -> None:
    # a failing job is retried, then dead: retried without a wait here
    fast_retries = {"backoff_base_s": 0.001, "backoff_max_s": 0.001}
    with run_stack(
        valkey, engines=[fast_engine], keyring=keyring(), broker_options=fast_retries
    ) as stack:
        with stack.client() as http:
            failed = http.post("/v1/completions", json={**BODY, "prompt": "[[fail]]"}, headers=KEY)
            assert failed.status_code == 500, failed.text
            ok = http.post("/v1/completions", json={**BODY, "prompt": "ok"}, headers=KEY)
            assert ok.status_code == 200, ok.text
            used = ok.json()["usage"]["total_tokens"]
        state = held(stack, valkey.url)
        assert state["active"] == 0 and state["held"] == [], state
        assert state["budget_used"] == used  # the failed job's tokens all came back


def test_job_expired_in_its_lane_frees_its_slot_when_found(valkey: EmbeddedServer) -> None:
    # one slot and one claimed ahead, both taken by another tenant's jobs for ~1 s: the
    # tenant's job, due in 0.3 s, is found expired when the worker reaches it, and its
    # reservation goes with that
    with (
        run_stack(
            valkey,
            engines=[slow_engine(0.05)],
            keyring=keyring(),
            worker_options={"max_seqs": 1, "claim_ahead": 1},
        ) as stack,
        stack.client() as http,
    ):
        blockers = [
            http.post("/v1/jobs", json={**BODY, "max_tokens": 20}, headers=OTHER).json()["id"]
            for _ in range(2)
        ]

        def claimed(job_id: str) -> bool:
            return http.get(f"/v1/jobs/{job_id}", headers=OTHER).json()["status"] != "queued"

        until(lambda: all(claimed(b) for b in blockers))  # the lane holds only the next one
        due = {**BODY, "deadline": time.time() + 0.3}
        queued = http.post("/v1/jobs", json=due, headers=KEY)
        assert queued.status_code == 202, queued.text
        job = queued.json()
        until(lambda: http.get(f"/v1/jobs/{job['id']}", headers=KEY).json()["status"] == "expired")
        assert_nothing_held(stack, valkey.url, request_back=False)
        next_is_admitted(http)


def test_broker_unreachable_at_enqueue_answers_503_and_refunds_when_it_answers(
    valkey: EmbeddedServer,
) -> None:
    enqueue_sha = hashlib.sha1(scripts.ENQUEUE.source().encode()).hexdigest().encode()
    with (
        Relay(valkey.port or 0, cut_on=enqueue_sha, down_s=1.0) as relay,
        run_stack(valkey, engines=[], keyring=keyring(), broker_url=relay.url) as stack,
        stack.client() as http,
    ):
        relay.armed = True
        answer = http.post("/v1/completions", json=BODY, headers=KEY)
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "broker_unavailable"
        assert relay.cut_at is not None
        # the refund could not be sent while the broker was away; it lands once it is back
        until(lambda: not relay.down())
        back = time.monotonic()
        until(lambda: held(stack, valkey.url)["held"] == [], within_s=3.0)
        assert time.monotonic() - back < 2.0  # not the sweep's 30 s
        assert_nothing_held(stack, valkey.url, request_back=True)
        next_is_admitted(http)
