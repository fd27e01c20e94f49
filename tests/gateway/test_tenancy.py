"""Keys and tenants in the broker, end to end: the CLI writes them, two gateways on one Valkey
honour them (and a revocation) within their cache time; data is tenant-scoped."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import openai
from typer.testing import CliRunner

from tests.gateway.conftest import MODEL, run_stack, slow_engine
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.cli import app

runner = CliRunner()


def cli(valkey: EmbeddedServer, prefix: str, *args: str) -> str:
    result = runner.invoke(app, [*args, "--broker", valkey.url, "--prefix", prefix])
    assert result.exit_code == 0, result.output
    return result.output


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def eventually(check: Callable[[], bool], within_s: float = 4.0) -> float:
    """Seconds until `check()` holds; fails past `within_s`."""
    start = time.monotonic()
    while not check():
        assert time.monotonic() - start < within_s, "never held"
        time.sleep(0.1)
    return time.monotonic() - start


def test_broker_keys_across_two_gateways(valkey: EmbeddedServer) -> None:
    with (
        run_stack(valkey, auth_cache_s=1.0) as one,
        run_stack(valkey, prefix=one.prefix, engines=[], auth_cache_s=1.0) as two,
        one.client() as a,
        two.client() as b,
    ):
        # no key stored yet: auth is off, the single caller is the fleet's admin
        assert a.get("/metrics").status_code == 200
        cli(valkey, one.prefix, "tenants", "set", "acme", "--priority", "high", "--weight", "2")
        cli(valkey, one.prefix, "tenants", "set", "ops", "--admin")
        created = cli(valkey, one.prefix, "keys", "create", "--tenant", "acme").split()
        acme, acme_id = created[-1], created[2]  # "key id <id> for tenant acme\n<key>"
        bob = cli(valkey, one.prefix, "keys", "create", "--tenant", "bob").strip().splitlines()[-1]
        ops = cli(valkey, one.prefix, "keys", "create", "--tenant", "ops").strip().splitlines()[-1]
        listed = cli(valkey, one.prefix, "keys", "list")
        assert acme not in listed and "acme" in listed and "bob" in listed

        # within the cache time, auth is on everywhere: nothing but health answers without a key
        for http in (a, b):
            eventually(lambda http=http: http.get("/v1/models").status_code == 401)
            assert http.get("/healthz").status_code == 200
            assert http.get("/metrics").status_code == 401
            assert http.get("/metrics", headers=bearer(bob)).status_code == 403
            assert http.get("/metrics", headers=bearer(ops)).status_code == 200
            assert http.get("/v1/models", headers=bearer("ty-made-up")).status_code == 401

        # the official client, through either gateway; the tier comes from the tenant record
        for http_url in (one.url, two.url):
            client = openai.OpenAI(base_url=http_url + "/v1", api_key=acme, max_retries=0)
            out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert out.usage is not None and out.usage.completion_tokens == 3
        job = a.post(
            "/v1/jobs", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, headers=bearer(acme)
        ).json()
        assert (job["tenant"], job["priority"]) == ("acme", "high")

        # isolation: another tenant's job is as absent as a missing one, on every route
        for http in (a, b):
            for method, path in (
                ("GET", f"/v1/jobs/{job['id']}"),
                ("GET", f"/v1/jobs/{job['id']}/events"),
                ("DELETE", f"/v1/jobs/{job['id']}"),
            ):
                assert http.request(method, path, headers=bearer(bob)).status_code == 404
        assert b.get(f"/v1/jobs/{job['id']}", headers=bearer(acme)).status_code == 200
        cli(valkey, one.prefix, "keys", "revoke", acme_id)
        took = max(
            eventually(lambda: a.get("/v1/models", headers=bearer(acme)).status_code == 401),
            eventually(lambda: b.get("/v1/models", headers=bearer(acme)).status_code == 401),
        )
        assert took < 2.5
        assert a.get("/v1/models", headers=bearer(bob)).status_code == 200
        shown = cli(valkey, one.prefix, "tenants", "show")
        assert "acme" in shown and "high" in shown and "ops" in shown


def quota_error(exc: openai.APIStatusError) -> tuple[int, dict[str, str]]:
    return exc.status_code, dict(exc.response.headers)


def test_quotas_are_exact_across_two_gateways(valkey: EmbeddedServer) -> None:
    with (
        run_stack(valkey, engines=[slow_engine(0.05)]) as one,
        run_stack(valkey, prefix=one.prefix, engines=[]) as two,
    ):
        cli(valkey, one.prefix, "tenants", "set", "acme", "--rpm", "10")
        cli(valkey, one.prefix, "tenants", "set", "solo", "--max-concurrent", "2")
        acme = cli(valkey, one.prefix, "keys", "create", "--tenant", "acme").split()[-1]
        solo = cli(valkey, one.prefix, "keys", "create", "--tenant", "solo").split()[-1]
        clients = [
            openai.OpenAI(base_url=s.url + "/v1", api_key=acme, max_retries=0) for s in (one, two)
        ]

        def call(i: int) -> tuple[int, dict[str, str]]:
            try:
                raw = clients[i % 2].completions.with_raw_response.create(
                    model=MODEL, prompt="hi", max_tokens=1
                )
                return raw.status_code, dict(raw.headers)
            except openai.APIStatusError as exc:
                return quota_error(exc)

        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(call, range(30)))
        statuses = [status for status, _ in answers]
        assert statuses.count(200) == 10 and statuses.count(429) == 20
        for status, headers in answers:
            assert headers["x-ratelimit-limit-requests"] == "10"
            if status == 429:
                assert 1 <= int(headers["retry-after"]) <= 6  # one interval

        # two jobs at once: the third waits for a terminal state, through either gateway
        slow = [
            openai.OpenAI(base_url=s.url + "/v1", api_key=solo, max_retries=0) for s in (one, two)
        ]

        def long_call(i: int) -> int:
            try:
                slow[i % 2].completions.create(model=MODEL, prompt="x", max_tokens=20)
                return 200
            except openai.APIStatusError as exc:
                return exc.status_code

        with ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(long_call, range(6)))
        assert codes.count(200) == 2 and codes.count(429) == 4
        # the slots came back with the jobs' completions
        assert long_call(0) == 200 and long_call(1) == 200
