"""Observability of a live `tokenyard serve`, end to end, on one shared stack.

One `serve` (configured only through TOKENYARD_* variables and a TOML file, so the CLI must
honour them), plus
one standalone worker with `--metrics-port`, both exporting traces over OTLP/HTTP to a receiver
in this test. A real Prometheus scrapes both and evaluates the alert rules; every panel of the
Grafana dashboard must return data; headless Chromium renders /dashboard.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.browser import artefacts, chromium, screenshot
from tests.tools import tools
from tokenyard.broker.redis.embedded import EmbeddedServer
from tokenyard.fleet.launch import Processes, free_port, wait_ready
from tokenyard.fleet.launch import tokenyard_command as tokenyard

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tokenyard.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = ALERTS.with_name("alerts_test.yml")  # each alert fires on its series, not on health
MODEL = "env-model"
# panels whose series exist only on some engines or devices (documented in their description)
CONDITIONAL_PANELS = {"KV cache usage", "Accelerator utilisation"}


@dataclass
class OtlpReceiver:
    """A minimal OTLP/HTTP trace receiver: decodes each protobuf export into spans."""

    port: int
    spans: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def by_trace(self, trace_id: str) -> list[dict[str, Any]]:
        with self.lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]


def start_receiver() -> tuple[OtlpReceiver, ThreadingHTTPServer]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )

    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    receiver = OtlpReceiver(server.server_address[1])

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            export = ExportTraceServiceRequest.FromString(body)
            with receiver.lock:
                for rs in export.resource_spans:
                    service = next(
                        a.value.string_value
                        for a in rs.resource.attributes
                        if a.key == "service.name"
                    )
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            receiver.spans.append(
                                {
                                    "service": service,
                                    "name": s.name,
                                    "trace_id": s.trace_id.hex(),
                                    "span_id": s.span_id.hex(),
                                    "parent": s.parent_span_id.hex(),
                                    "start": s.start_time_unix_nano,
                                    "end": s.end_time_unix_nano,
                                }
                            )
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            pass

    server.RequestHandlerClass = Handler
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return receiver, server


@dataclass
class Live:
    base: str
    worker_metrics: str
    receiver: OtlpReceiver
    tmp: Path


@pytest.fixture(scope="module")
def live(valkey: EmbeddedServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("obs")
    receiver, otlp = start_receiver()
    port, metrics_port = free_port(), free_port()
    prefix = f"o{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOKENYARD_", "OTEL_"))}
    config = tmp / "tokenyard.toml"  # serve's workers inherit TOKENYARD_CONFIG and read it too
    config.write_text(
        "[broker]\nmax_deliveries = 2\nbackoff_base_s = 0.05\n"
        "[worker]\nengine = 'sim'\nheartbeat_s = 0.5\nlog_stats_s = 0.5\n"
        "model = 'overridden-by-env'\n"
    )
    env.update(
        TOKENYARD_CONFIG=str(config),
        TOKENYARD_BROKER_URL=valkey.url,
        TOKENYARD_BROKER_PREFIX=prefix,
        TOKENYARD_WORKER_MODEL=MODEL,
        TOKENYARD_GATEWAY_HOST="127.0.0.1",
        TOKENYARD_GATEWAY_PORT=str(port),
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{receiver.port}",
        OTEL_BSP_SCHEDULE_DELAY="200",
    )
    procs = Processes()
    with (tmp / "serve.log").open("wb") as serve_log:
        procs.start(
            "serve",
            tokenyard("serve", "--data-dir", str(tmp / "valkey")),
            env=env,
            stderr=serve_log,
        )
    with (tmp / "worker.log").open("wb") as worker_log:
        procs.start(
            "worker",
            tokenyard("worker", "--metrics-port", str(metrics_port), "--log-format", "json"),
            env=env,
            stderr=worker_log,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(f"{base}/readyz", procs, timeout_s=120)
        yield Live(base, f"http://127.0.0.1:{metrics_port}", receiver, tmp)
    finally:
        procs.stop(timeout_s=30)
        otlp.shutdown()


def test_serve_takes_model_engine_and_port_from_the_environment(live: Live) -> None:
    models = httpx.get(f"{live.base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    give_up = time.monotonic() + 60
    while (workers := httpx.get(f"{live.base}/readyz").json()["workers"]) != {MODEL: 2}:
        # serve's own worker and the standalone one: both took the model from the environment
        assert time.monotonic() < give_up, workers
        time.sleep(0.3)


def test_submit_finds_the_gateway_and_model_in_the_environment(live: Live) -> None:
    port = live.base.rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENYARD_")}
    env.update(TOKENYARD_GATEWAY_PORT=port, TOKENYARD_GATEWAY_MODELS=MODEL)
    submitted = subprocess.run(
        tokenyard("submit", "hello", "--max-tokens", "5"),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    assert submitted.stdout.strip()


def test_invalid_values_are_openai_bad_requests(live: Live) -> None:
    client = openai.OpenAI(base_url=f"{live.base}/v1", api_key="unused", max_retries=0)
    for bad, param in (
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 7}, "top_p"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="hi", **bad)  # type: ignore[call-overload]
        assert caught.value.status_code == 400
        error = caught.value.body
        assert isinstance(error, dict)
        assert error["type"] == "invalid_request_error" and error["param"] == param


def _load(base: str, n: int) -> None:
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

    def one(i: int) -> None:
        if i % 2:
            stream = client.completions.create(
                model=MODEL, prompt=f"load {i}", max_tokens=12, stream=True
            )
            assert "".join(c.choices[0].text for c in stream)
        else:
            client.completions.create(model=MODEL, prompt=f"load {i}", max_tokens=12)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(n)))


def test_one_trace_spans_gateway_and_worker_over_otlp(live: Live) -> None:
    trace_id = uuid.uuid4().hex
    parent = uuid.uuid4().hex[:16]
    reply = httpx.post(
        f"{live.base}/v1/completions",
        json={"model": MODEL, "prompt": "traced", "max_tokens": 8, "stream": True},
        headers={"traceparent": f"00-{trace_id}-{parent}-01"},
        timeout=30,
    )
    assert reply.status_code == 200
    wanted = {
        "POST /v1/completions",
        "tokenyard.admission",
        "tokenyard.enqueue",
        "tokenyard.queue_wait",
        "tokenyard.job",
        "tokenyard.claim",
        "tokenyard.prefill",
        "tokenyard.decode",
        "tokenyard.complete",
    }
    give_up = time.monotonic() + 20
    while {s["name"] for s in live.receiver.by_trace(trace_id)} < wanted:
        assert time.monotonic() < give_up, live.receiver.by_trace(trace_id)
        time.sleep(0.2)
    spans = {s["name"]: s for s in live.receiver.by_trace(trace_id)}
    assert spans["POST /v1/completions"]["service"] == "tokenyard-gateway"
    assert spans["tokenyard.job"]["service"] == "tokenyard-worker"
    # the client's span is the root's parent; the worker's spans hang under the gateway's
    server = spans["POST /v1/completions"]
    assert server["parent"] == parent
    assert spans["tokenyard.job"]["parent"] == server["span_id"]
    assert spans["tokenyard.queue_wait"]["parent"] == server["span_id"]
    for child in ("tokenyard.claim", "tokenyard.prefill", "tokenyard.decode"):
        assert spans[child]["parent"] == spans["tokenyard.job"]["span_id"]
    assert spans["tokenyard.prefill"]["end"] <= spans["tokenyard.decode"]["end"]
    # across processes too, the worker's spans start inside the request's, none lasting < 0
    wait, job = spans["tokenyard.queue_wait"], spans["tokenyard.job"]
    assert server["start"] <= wait["start"] <= wait["end"] <= job["start"] <= job["end"]


def test_standalone_worker_serves_metrics_and_json_logs(live: Live) -> None:
    _load(live.base, 8)
    text = httpx.get(f"{live.worker_metrics}/metrics").text
    assert f'tokenyard_worker_claims_total{{model="{MODEL}"}}' in text
    assert "tokenyard_worker_batch_size_bucket" in text
    lines = [ln for ln in (live.tmp / "worker.log").read_text().splitlines() if ln.strip()]
    assert lines and all(json.loads(ln)["level"] for ln in lines)


def test_gateway_and_workers_say_they_started_and_log_each_request_and_their_stats(
    live: Live,
) -> None:
    _load(live.base, 2)
    port = live.base.rsplit(":", 1)[1]
    give_up = time.monotonic() + 20
    while True:  # a request's line is written once its answer has gone; stats every 0.5 s
        serve = (live.tmp / "serve.log").read_text()
        worker = [json.loads(ln) for ln in (live.tmp / "worker.log").read_text().splitlines()]
        stats = [ln for ln in worker if ln["logger"] == "tokenyard.worker.stats"]
        if "tokenyard.access POST /v1/completions 200 " in serve and stats:
            break
        assert time.monotonic() < give_up, serve + str(worker)
        time.sleep(0.1)
    assert f"tokenyard.gateway gateway started on http://127.0.0.1:{port}: models {MODEL}" in serve
    assert "worker " in serve and f"started: model {MODEL}, engine sim" in serve  # serve's own
    assert any(ln["message"].endswith(f"started: model {MODEL}, engine sim, 64 slots")
               for ln in worker)  # fmt: skip
    assert stats[0]["message"] == "stats" and stats[0]["level"] == "INFO"
    assert {"running", "waiting", "generation_tokens_per_s", "worker"} <= set(stats[0])


def _query(prom: str, expr: str) -> list[dict[str, Any]]:
    reply = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def _has_data(result: list[dict[str, Any]]) -> bool:
    return any(not math.isnan(float(r["value"][1])) for r in result)


@pytest.fixture(scope="module")
def prometheus(live: Live) -> Iterator[str]:
    [binary] = tools("prometheus", package="prometheus")
    port = free_port()
    gateway, worker = live.base.removeprefix("http://"), live.worker_metrics.removeprefix("http://")
    config = live.tmp / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{ALERTS}']\n"
        "scrape_configs:\n"
        f"  - job_name: tokenyard\n    static_configs: [{{targets: ['{gateway}', '{worker}']}}]\n"
    )
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={live.tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(live.tmp / "prometheus.log").open("wb"),
    )  # fmt: skip
    prom = f"http://127.0.0.1:{port}"
    try:
        give_up = time.monotonic() + 30
        while True:  # both targets scraped once before the load, so rates have a baseline
            assert proc.poll() is None, (live.tmp / "prometheus.log").read_text()[-2000:]
            try:
                if len(_query(prom, 'up{job="tokenyard"} == 1')) == 2:
                    break
            except (httpx.TransportError, json.JSONDecodeError):
                pass  # not listening yet, or still starting (its API answers 503 text)
            assert time.monotonic() < give_up, "prometheus never scraped both targets"
            time.sleep(0.3)
        yield prom
    finally:
        proc.terminate()
        proc.wait(30)


def test_prometheus_scrapes_live_metrics_and_every_panel_has_data(
    live: Live, prometheus: str
) -> None:
    # a job that fails every delivery: retries, then a dead letter
    failing = httpx.post(
        f"{live.base}/v1/jobs", json={"model": MODEL, "prompt": "[[fail]]", "max_tokens": 4}
    )
    assert failing.status_code == 202
    httpx.post(f"{live.base}/v1/completions", json={"model": MODEL, "max_tokens": -1})  # a 400
    for _ in range(2):  # two waves, seconds apart, so every rate sees its counters move
        _load(live.base, 24)
        time.sleep(2.5)
    panels = json.loads(DASHBOARD.read_text())["panels"]
    pending = {(p["title"], t["expr"]) for p in panels for t in p["targets"]}
    give_up = time.monotonic() + 30
    while True:
        pending = {(t, e) for t, e in pending if not _has_data(_query(prometheus, e))}
        if {t for t, _ in pending} <= CONDITIONAL_PANELS or time.monotonic() > give_up:
            break
        time.sleep(1)
    assert {t for t, _ in pending} <= CONDITIONAL_PANELS, sorted(pending)
    assert _query(prometheus, f'tokenyard_worker_dead_letters_total{{model="{MODEL}"}} > 0')
    assert _query(prometheus, f'tokenyard_worker_retries_total{{model="{MODEL}"}} > 0')
    # both workers' counters: serve's (through the gateway) and the standalone one
    claims = _query(prometheus, "tokenyard_worker_claims_total > 0")
    assert {r["metric"]["instance"] for r in claims} == {
        live.base.removeprefix("http://"),
        live.worker_metrics.removeprefix("http://"),
    }
    groups = httpx.get(f"{prometheus}/api/v1/rules").json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) == 7 and all(r["health"] == "ok" for r in rules), rules


def test_alert_rules_pass_promtool_check_and_unit_tests() -> None:
    [promtool] = tools("promtool", package="prometheus")
    for command in (["check", "rules", str(ALERTS)], ["test", "rules", str(ALERT_TESTS)]):
        checked = subprocess.run(
            [promtool, *command], capture_output=True, text=True, timeout=60, cwd=ALERTS.parent
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr


def test_dashboard_page_shows_a_new_job_in_chromium(live: Live, tmp_path: Path) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with chromium(tmp_path / "profile") as browser:
        browser.get(f"{live.base}/dashboard")
        # the page re-renders each poll: an element read mid-render is stale, so look again
        wait = WebDriverWait(browser, 20, ignored_exceptions=[StaleElementReferenceException])
        wait.until(lambda b: MODEL in b.find_element(By.ID, "models").text)
        job = httpx.post(
            f"{live.base}/v1/jobs", json={"model": MODEL, "prompt": "watch me", "max_tokens": 6}
        ).json()["id"]
        # the page polls: the job appears, then its terminal status, without a reload
        wait.until(lambda b: job in b.find_element(By.ID, "jobs").text)
        wait.until(
            lambda b: any(
                job in line and "succeeded" in line
                for line in b.find_element(By.ID, "jobs").text.splitlines()
            )
        )
        assert "no live worker" not in browser.find_element(By.ID, "models").text
        # the completion rate comes from the workers' counters over a window
        wait.until(
            lambda b: b.find_element(By.CSS_SELECTOR, ".rate").text != "\u2013"
        )  # not the placeholder dash
        float(browser.find_element(By.CSS_SELECTOR, ".rate").text)
        screenshot(browser, artefacts(tmp_path), "dashboard-serve.png")
