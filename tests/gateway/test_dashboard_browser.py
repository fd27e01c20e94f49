"""/dashboard in headless Chromium with an admin key: charts drawn from live data, per-worker
rows, a dead letter with its reason, a new job appearing, and the three actions (cancel a
queued job, requeue a dead letter, drain a worker) checked through the API; the history
recorded before the page opened (answers by status with a 429 and a 5xx, a tenant's budget
left) and one job's view. Screenshots go to the test artefacts (tests/browser.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.browser import artefacts, chromium, screenshot
from tests.gateway.conftest import MODEL, Stack, run_stack
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.gateway.auth import KeyRing, Tenant
from tokenyard.tenancy.limiter import Quota

IDLE = "idle-model"  # served with no worker: its jobs stay queued, to be cancelled
pytestmark = pytest.mark.slow
ADMIN_KEY, TENANT_KEY, LIMITED_KEY = "sk-ops", "sk-acme", "sk-tiny"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
TENANT = {"Authorization": f"Bearer {TENANT_KEY}"}
LIMITED = {"Authorization": f"Bearer {LIMITED_KEY}"}
BUDGET = 10_000


@pytest.fixture
def ops(valkey: EmbeddedServer) -> Iterator[Stack]:
    keyring = KeyRing(
        {
            ADMIN_KEY: Tenant("ops", admin=True),
            TENANT_KEY: Tenant("acme"),
            # two requests a minute, and a budget: its 429s and budget left are charted
            LIMITED_KEY: Tenant("tiny", quota=Quota(rpm=2, token_budget=BUDGET)),
        }
    )
    with run_stack(
        valkey,
        keyring=keyring,
        models=(MODEL, IDLE),
        broker_options={"max_deliveries": 1},
        dashboard_interval_s=0.5,  # a point each half second, recorded whoever watches
    ) as stack:
        yield stack


def until(check: Callable[[], Any], timeout_s: float = 20.0, what: str = "") -> Any:
    """Poll `check` until it is truthy, ignoring page elements not rendered yet or
    re-rendered under it (each poll redraws the tables)."""
    from selenium.common.exceptions import (
        NoSuchElementException,
        StaleElementReferenceException,
    )

    give_up = time.monotonic() + timeout_s
    while True:
        try:
            if value := check():
                return value
        except (NoSuchElementException, StaleElementReferenceException):
            pass
        assert time.monotonic() < give_up, f"timed out waiting for {what or check}"
        time.sleep(0.1)


def load(url: str, stop: threading.Event) -> None:
    """Completions, streamed and not, until `stop`: the charts' data."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=TENANT_KEY, max_retries=0)

    def one(i: int) -> None:
        if i % 2:
            for _ in client.completions.create(
                model=MODEL, prompt=f"load {i}", max_tokens=16, stream=True
            ):
                pass
        else:
            client.completions.create(model=MODEL, prompt=f"load {i}", max_tokens=16)

    with ThreadPoolExecutor(4) as pool:
        i = 0
        while not stop.is_set():
            list(pool.map(one, range(i, i + 8)))
            i += 8


def test_the_dashboard_charts_the_fleet_and_its_actions_work(ops: Stack, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    where = artefacts(tmp_path)
    extra = ops.start_worker()  # the one to drain
    api = httpx.Client(base_url=ops.url, timeout=30)
    stop = threading.Event()
    loader = threading.Thread(target=load, args=(ops.url, stop), daemon=True)
    with chromium(tmp_path / "profile") as browser:
        browser.set_window_size(1400, 2600)
        try:
            browser.get(f"{ops.url}/dashboard?poll=0.5")  # a point recorded each 0.5 s
            # no key yet: the page asks for one
            until(lambda: browser.find_element(By.ID, "auth").is_displayed(), what="key box")
            browser.find_element(By.ID, "key").send_keys(ADMIN_KEY)
            browser.find_element(By.ID, "save").click()
            models = browser.find_element(By.ID, "models")
            until(lambda: MODEL in models.text and IDLE in models.text, what="both models")

            def section(model: str) -> Any:
                return browser.find_element(By.CSS_SELECTOR, f'section[data-model="{model}"]')

            # per-worker rows: the stack's worker and the extra one
            until(
                lambda: len(section(MODEL).find_elements(By.CSS_SELECTOR, "tr.worker")) == 2,
                what="two worker rows",
            )
            # a new job appears, without a reload
            queued = api.post(
                "/v1/jobs", json={"model": IDLE, "prompt": "wait", "max_tokens": 4}, headers=TENANT
            ).json()["id"]
            until(lambda: queued in browser.find_element(By.ID, "jobs").text, what="new job")
            # a dead letter, listed with its reason
            dead = api.post(
                "/v1/jobs",
                json={"model": MODEL, "prompt": "[[fail]]", "max_tokens": 4},
                headers=TENANT,
            ).json()["id"]
            until(
                lambda: any(
                    dead in r.text and "failed" in r.text
                    for r in section(MODEL).find_elements(By.CSS_SELECTOR, "tr.dead")
                ),
                what="the dead letter with its reason",
            )
            # charts drawn from data: five per model, a canvas each, the load's points in them
            loader.start()
            for model in (MODEL, IDLE):
                assert len(section(model).find_elements(By.CSS_SELECTOR, ".uplot canvas")) == 5
            drawn = (
                "const d = window.dashboard.views[arguments[0]].data;"
                "const some = (id, i) => d[id][i].some((v) => v != null && v > 0);"
                "return d.jobs[0].length > 2 && some('jobs', 1) && some('tokens', 1) &&"
                " some('latency', 1) && some('latency', 4) && some('batch', 1);"
            )
            until(lambda: browser.execute_script(drawn, MODEL), 30, "every chart's data")
            rate = section(MODEL).find_element(By.CSS_SELECTOR, ".rate").text
            assert float(rate) > 0
            screenshot(browser, where, "dashboard.png")
            stop.set()
            loader.join(30)

            def click(action: str, target: str) -> None:
                css = f'button[data-action="{action}"][data-id="{target}"]'
                until(lambda: browser.find_element(By.CSS_SELECTOR, css).click() or True)

            # the load's jobs pushed it off the recent list: a new one to cancel
            queued = api.post(
                "/v1/jobs", json={"model": IDLE, "prompt": "wait", "max_tokens": 4}, headers=TENANT
            ).json()["id"]
            # cancel a queued job (another tenant's): the tenant sees it cancelled
            click("cancel", queued)
            until(
                lambda: (
                    api.get(f"/v1/jobs/{queued}", headers=TENANT).json()["status"] == "cancelled"
                ),
                what="the job cancelled",
            )
            # requeue the dead letter: a new job, shown beside it
            click("requeue", dead)

            def requeued() -> str | None:
                rows = api.get("/admin/dead_letters", headers=ADMIN).json()["data"]
                found: str | None = {r["job_id"]: r["requeued_as"] for r in rows}.get(dead)
                return found

            new = until(requeued, what="the dead letter requeued")
            assert api.get(f"/v1/jobs/{new}", headers=TENANT).status_code == 200
            until(lambda: "requeued as" in section(MODEL).text, what="requeued shown")
            # drain the extra worker: it leaves the registry, the stack's worker stays
            click("drain", extra.consumer)

            def consumers() -> set[str]:
                data = api.get("/dashboard/data", headers=ADMIN).json()
                return {w["consumer"] for m in data["models"] for w in m["workers"]}

            until(lambda: extra.consumer not in consumers(), what="the worker drained")
            assert len(consumers()) == 1
            until(
                lambda: len(section(MODEL).find_elements(By.CSS_SELECTOR, "tr.worker")) == 1,
                what="one worker row",
            )
            assert "draining" in browser.find_element(By.ID, "notice").text
            screenshot(browser, where, "dashboard-after-actions.png")
        finally:
            stop.set()
            if loader.is_alive():
                loader.join(30)
            api.close()


def test_the_dashboard_shows_what_was_recorded_before_it_opened_and_one_job(
    ops: Stack, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    where = artefacts(tmp_path)
    api = httpx.Client(base_url=ops.url, timeout=30)
    # traffic before any browser: answers, a 429 (the tenant's two requests a minute are
    # used), a 5xx (a job that fails on its one delivery), tokens against a budget
    body = {"model": MODEL, "prompt": "before", "max_tokens": 4}
    statuses = [
        api.post("/v1/completions", json=body, headers=LIMITED).status_code for _ in range(3)
    ]
    assert statuses == [200, 200, 429]
    kept = api.post("/v1/jobs", json=body, headers=TENANT).json()["id"]
    failed = api.post("/v1/completions", json={**body, "prompt": "[[fail]]"}, headers=TENANT)
    assert failed.status_code == 500
    time.sleep(2.0)  # a few more points, with nobody watching
    opened = time.time()
    with chromium(tmp_path / "profile") as browser:
        browser.set_window_size(1400, 2600)
        try:
            browser.get(f"{ops.url}/dashboard?poll=0.5")
            until(lambda: browser.find_element(By.ID, "auth").is_displayed(), what="key box")
            browser.find_element(By.ID, "key").send_keys(ADMIN_KEY)
            browser.find_element(By.ID, "save").click()
            # the first poll drew the history: points from before the page opened
            before = (
                "const d = window.dashboard, at = arguments[0], m = d.views[arguments[1]];"
                "if (!d.traffic.data || !m) return null;"
                "const xs = d.traffic.data[0], old = (i) => xs[i] < at;"
                "const some = (col) => d.traffic.data[col].some((v, i) => old(i) && v > 0);"
                "return {points: xs.filter((t) => t < at).length, ok: some(1), limited: some(3),"
                " failed: some(4), model: m.data.depth[0].filter((t) => t < at).length,"
                " span: d.traffic.chart.scales.x.max - d.traffic.chart.scales.x.min};"
            )
            seen = until(
                lambda: (r := browser.execute_script(before, opened, MODEL)) and r["points"] and r,
                what="the history",
            )
            assert seen["points"] >= 4 and seen["model"] >= 4, seen
            assert seen["ok"] and seen["limited"] and seen["failed"], seen
            assert 300 <= seen["span"] <= 3700, seen  # minutes, not a year
            # the tenant: its requests, its 429s, its budget left (the quota table's)
            table = browser.find_element(By.ID, "tenant-table")
            tiny = until(
                lambda: next(
                    (
                        r.text
                        for r in table.find_elements(By.CSS_SELECTOR, "tr.tenant")
                        if "tiny" in r.text
                    ),
                    None,
                ),
                what="the tenant's row",
            )
            left = int(tiny.split()[-1])
            assert 0 < left < BUDGET, tiny
            assert len(browser.find_elements(By.CSS_SELECTOR, "#tenant-charts .uplot canvas")) == 4
            screenshot(browser, where, "dashboard-history.png")
            # one job by its id: the failed one, then the one read later, by its link
            dead = api.get("/admin/dead_letters", headers=ADMIN).json()["data"][0]["job_id"]
            browser.find_element(By.ID, "job-id").send_keys(dead)
            browser.find_element(By.ID, "job-show").click()

            def view(job_id: str) -> dict[str, str] | None:
                """The job view's fields once it shows `job_id` (read at once: it is redrawn)."""
                fields: dict[str, str] = browser.execute_script(
                    "return Object.fromEntries([...document.querySelectorAll('#job tr')]"
                    ".map((r) => [r.dataset.field, r.querySelector('td').innerText]));"
                )
                return fields if fields.get("job") == job_id else None

            shown = until(lambda: view(dead), what="the failed job's view")
            assert shown["status"] == "dead" and shown["deliveries"] == "1", shown
            assert shown["error"] and shown["worker"], shown
            until(lambda: kept in browser.find_element(By.ID, "jobs").text, what="the job listed")

            def follow_link() -> bool:
                # found and clicked in one poll: the list is redrawn under it between the two
                browser.find_element(By.CSS_SELECTOR, f'#jobs a[href="#job={kept}"]').click()
                return True

            until(follow_link, what="the job's link followed")
            shown = until(lambda: view(kept), what="the job's view by its link")
            assert shown["status"] == "succeeded" and shown["error"] == "", shown
            assert "4 tokens" in shown["events"] and "finished: succeeded" in shown["events"]
            assert ":" in shown["first token"] and ":" in shown["started"], shown  # times
            screenshot(browser, where, "dashboard-job.png")
        finally:
            api.close()
