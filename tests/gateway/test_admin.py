"""The operators' routes over HTTP (tokenyard/gateway/routes/admin.py): admin key only, with
OpenAI-shaped errors; requeue a dead letter, drain a worker, cancel any tenant's job."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.auth import KeyRing, Tenant

IDLE = "idle-model"  # served, with no worker: its jobs stay queued
ADMIN = {"Authorization": "Bearer sk-ops"}
TENANT = {"Authorization": "Bearer sk-acme"}


@pytest.fixture(scope="module")
def ops(valkey: EmbeddedServer) -> Iterator[Stack]:
    keyring = KeyRing({"sk-ops": Tenant("ops", admin=True), "sk-acme": Tenant("acme")})
    with run_stack(
        valkey,
        keyring=keyring,
        models=(MODEL, IDLE),
        broker_options={"max_deliveries": 1},
    ) as stack:
        yield stack


def wait_for(check: object, timeout_s: float = 20.0) -> None:
    give_up = time.monotonic() + timeout_s
    while not callable(check) or not check():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.05)


def dead_job(client: httpx.Client) -> str:
    """A job that fails its one delivery: a dead letter."""
    reply = client.post(
        "/v1/jobs", json={"model": MODEL, "prompt": "[[fail]]", "max_tokens": 4}, headers=TENANT
    )
    job: str = reply.json()["id"]
    wait_for(lambda: client.get(f"/v1/jobs/{job}", headers=TENANT).json()["status"] == "dead")
    return job


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/admin/dead_letters"),
        ("POST", "/admin/dead_letters/x/requeue"),
        ("POST", "/admin/workers/x/drain"),
        ("POST", "/admin/jobs/x/cancel"),
    ],
)
def test_admin_routes_need_an_admin_key(ops: Stack, method: str, path: str) -> None:
    with ops.client() as client:
        for headers, status, code in ((TENANT, 403, "admin_required"), ({}, 401, None)):
            reply = client.request(method, path, headers=headers)
            assert reply.status_code == status
            error = reply.json()["error"]
            assert set(error) >= {"message", "type", "param", "code"}
            if code:
                assert error["code"] == code


def test_a_dead_letter_is_listed_with_its_reason_and_requeued_once(ops: Stack) -> None:
    with ops.client() as client:
        job = dead_job(client)
        listed = client.get("/admin/dead_letters", params={"model": MODEL}, headers=ADMIN)
        [row] = [d for d in listed.json()["data"] if d["job_id"] == job]
        assert row["reason"] == "failed" and "fail" in row["error"] and row["requeued_as"] is None
        first = client.post(f"/admin/dead_letters/{job}/requeue", headers=ADMIN)
        assert first.status_code == 201, first.text
        new = first.json()["requeued_as"]
        assert new != job and first.json()["status"] == "requeued"
        again = client.post(f"/admin/dead_letters/{job}/requeue", headers=ADMIN)
        assert again.status_code == 200 and again.json()["requeued_as"] == new
        # the new job is the tenant's (it asked for the first): it ran, and failed again
        wait_for(lambda: client.get(f"/v1/jobs/{new}", headers=TENANT).json()["status"] == "dead")
        listed = client.get("/admin/dead_letters", headers=ADMIN).json()["data"]
        assert {d["job_id"]: d["requeued_as"] for d in listed}[job] == new
        ok = client.post(
            "/v1/jobs", json={"model": MODEL, "prompt": "fine", "max_tokens": 2}, headers=TENANT
        ).json()["id"]
        wait_for(lambda: client.get(f"/v1/jobs/{ok}", headers=TENANT).json()["status"] != "queued")
        wait_for(lambda: client.get(f"/v1/jobs/{ok}", headers=TENANT).json()["status"] != "running")
        alive = client.post(f"/admin/dead_letters/{ok}/requeue", headers=ADMIN)
        assert alive.status_code == 409 and alive.json()["error"]["code"] == "not_a_dead_letter"
        for unknown in ("nope", "00000000-" + "0" * 32):
            missing = client.post(f"/admin/dead_letters/{unknown}/requeue", headers=ADMIN)
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


def test_an_admin_cancels_another_tenant_s_queued_job(ops: Stack) -> None:
    with ops.client() as client:
        reply = client.post(
            "/v1/jobs", json={"model": IDLE, "prompt": "wait", "max_tokens": 4}, headers=TENANT
        )
        assert reply.status_code == 202, reply.text
        job = reply.json()["id"]
        cancelled = client.post(f"/admin/jobs/{job}/cancel", headers=ADMIN)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        assert client.get(f"/v1/jobs/{job}", headers=TENANT).json()["status"] == "cancelled"
        again = client.post(f"/admin/jobs/{job}/cancel", headers=ADMIN)
        assert again.status_code == 409 and again.json()["error"]["code"] == "job_finished"
        assert client.post("/admin/jobs/nope/cancel", headers=ADMIN).status_code == 404


def test_an_admin_drains_a_worker_by_name_and_it_leaves(ops: Stack) -> None:
    worker = ops.start_worker()
    with ops.client() as client:

        def names() -> set[str]:
            data = client.get("/dashboard/data", headers=ADMIN).json()
            return {w["consumer"] for m in data["models"] for w in m["workers"]}

        wait_for(lambda: worker.consumer in names())
        reply = client.post(f"/admin/workers/{worker.consumer}/drain", headers=ADMIN)
        assert reply.status_code == 202, reply.text
        assert reply.json() == {"worker": worker.consumer, "model": MODEL, "state": "draining"}
        wait_for(lambda: worker.consumer not in names())  # it drained, deregistered and left
        assert len(names()) == 1  # the stack's own worker serves on
        gone = client.post(f"/admin/workers/{worker.consumer}/drain", headers=ADMIN)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "worker_not_found"
