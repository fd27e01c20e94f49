"""Log formats, the OTEL_* switch, and CLI settings precedence (flag > environment > default)."""

from __future__ import annotations

import io
import json
import logging
import os
import uuid
import warnings

import pytest

from tokenyard import tracing
from tokenyard.cli.app import _gateway_settings
from tokenyard.errors import FatalError
from tokenyard.logs import (
    Fields,
    JsonFormatter,
    LogFormat,
    TextFormatter,
    job_fields,
    setup_logging,
)
from tokenyard.messages import EngineStats
from tokenyard.worker.stats import StatsLine

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _record(extra: dict[str, str]) -> logging.LogRecord:
    logger = logging.getLogger("tokenyard.test")
    return logger.makeRecord(
        logger.name, logging.WARNING, __file__, 1, "job %s", ("j1",), None, extra=extra
    )


def test_json_lines_carry_job_and_trace_ids() -> None:
    line = JsonFormatter().format(_record(job_fields("j1", {"traceparent": TRACEPARENT})))
    out = json.loads(line)
    assert out["message"] == "job j1" and out["level"] == "WARNING"
    assert out["job_id"] == "j1" and out["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    text = TextFormatter().format(_record(job_fields("j1")))
    assert text.endswith("job j1 [job_id=j1]")


@pytest.mark.usefixtures("root_logging")
def test_setup_logging_json_writes_one_object_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    setup_logging("info", LogFormat.JSON)
    logging.getLogger("x").info("hello", extra=job_fields("j2"))
    [line] = stream.getvalue().splitlines()
    assert json.loads(line)["job_id"] == "j2"


@pytest.mark.usefixtures("root_logging")
def test_json_logs_are_json_for_every_librarys_lines_too(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    # a library imported before setup, printing through a console handler of its own
    early = logging.getLogger(f"early-{uuid.uuid4().hex}")
    early.addHandler(logging.StreamHandler(stream))
    early.propagate = False
    setup_logging("info", LogFormat.JSON, process="worker-3")
    early.warning("from before")
    # one imported after: what transformers does on import (its batching manager's logger)
    late = logging.getLogger(f"late-{uuid.uuid4().hex}")
    late.addHandler(logging.StreamHandler())
    late.propagate = False
    late.warning("from after")
    file_handler = logging.StreamHandler(io.StringIO())  # not a console's: kept
    late.addHandler(file_handler)
    assert late.handlers == [file_handler]
    late.removeHandler(file_handler)
    warnings.warn("a library's warning", UserWarning, stacklevel=1)
    logging.getLogger("httpx").info('HTTP Request: POST http://up/v1 "HTTP/1.1 200 OK"')
    logging.getLogger("ContinuousBatchingLogger").info("Paged cache initialized")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]  # every one JSON
    assert [(o["logger"], o["level"]) for o in lines] == [
        (early.name, "WARNING"),
        (late.name, "WARNING"),
        ("py.warnings", "WARNING"),
    ]
    assert "a library's warning" in lines[2]["message"]
    assert {o["process"] for o in lines} == {"worker-3"}
    # at DEBUG the chatter shows, as DEBUG
    setup_logging("debug", LogFormat.TEXT, process="worker-{pid}")
    logging.getLogger("httpx").info("HTTP Request: GET http://up/v1/models")
    last = stream.getvalue().splitlines()[-1]
    assert last.startswith(f"[worker-{os.getpid()}] ")
    assert " DEBUG httpx HTTP Request: GET http://up/v1/models" in last


def test_malformed_traceparent_gives_no_trace_id() -> None:
    assert job_fields("j", {"traceparent": "garbage"}) == {"job_id": "j"}


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
    ],
)
def test_tracing_is_on_only_when_otel_variables_ask(env: dict[str, str], on: bool) -> None:
    assert tracing.wanted(env) is on


def test_gateway_options_fall_back_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TOKENYARD_GATEWAY_TOKENIZER", "TOKENYARD_GATEWAY_MODELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKENYARD_GATEWAY_PORT", "9123")
    monkeypatch.setenv("TOKENYARD_GATEWAY_HOST", "0.0.0.0")
    monkeypatch.setenv("TOKENYARD_GATEWAY_MODELS", "a,b")
    monkeypatch.setenv("TOKENYARD_WORKER_ENGINE", "sim")
    s = _gateway_settings(None, None, None, None)
    assert (s.host, s.port, s.models, s.tokenizer) == ("0.0.0.0", 9123, ("a", "b"), "sim")
    s = _gateway_settings("m", "hf", "127.0.0.1", 8001)  # flags win
    assert (s.host, s.port, s.models, s.tokenizer) == ("127.0.0.1", 8001, ("m",), "hf")
    monkeypatch.delenv("TOKENYARD_WORKER_ENGINE")
    for name in ("TOKENYARD_GATEWAY_PORT", "TOKENYARD_GATEWAY_HOST", "TOKENYARD_GATEWAY_MODELS"):
        monkeypatch.delenv(name)
    s = _gateway_settings(None, None, None, None)  # the settings' defaults
    assert (s.host, s.port, s.models, s.tokenizer) == ("127.0.0.1", 8000, ("tiny",), "hf")


def test_worker_metrics_fold_engine_counters_per_delivery() -> None:
    from tokenyard.messages import EngineStats
    from tokenyard.metrics import WorkerMetrics

    m = WorkerMetrics("m")
    value = m.registry.get_sample_value
    labels = {"model": "m"}
    # two steps of 4 sequences, delivered together after 0.02 s of busy waiting
    m.engine_delivered(EngineStats(steps=2, sequences_stepped=8, tokens_generated=8,
                                   prefill_tokens=40), 0.02)  # fmt: skip
    assert value("tokenyard_worker_batch_size_count", labels) == 2
    assert value("tokenyard_worker_batch_size_sum", labels) == 8
    assert value("tokenyard_worker_step_seconds_sum", labels) == pytest.approx(0.02)
    # one more step after an idle wait: its batch counts, its wait is no step time
    m.engine_delivered(EngineStats(steps=3, sequences_stepped=9, tokens_generated=9,
                                   prefill_tokens=40, prefix_cache_queries=40,
                                   prefix_cache_hits=32), None)  # fmt: skip
    assert value("tokenyard_worker_batch_size_count", labels) == 3
    assert value("tokenyard_worker_step_seconds_count", labels) == 2
    assert value("tokenyard_worker_decode_tokens_total", labels) == 9
    assert value("tokenyard_worker_prefill_tokens_total", labels) == 40
    assert value("tokenyard_worker_prefix_cache_queries_total", labels) == 40
    assert value("tokenyard_worker_prefix_cache_hits_total", labels) == 32
    m.sample(3, 1, 12.5, EngineStats(kv_cache_usage=0.25), ("cuda:0", 0.5))
    assert value("tokenyard_worker_running_sequences", labels) == 3
    assert value("tokenyard_worker_kv_cache_usage_ratio", labels) == 0.25
    assert value("tokenyard_accelerator_utilization_ratio", {**labels, "device": "cuda:0"}) == 0.5


def test_fields_read_as_key_values_in_text_and_as_keys_in_json() -> None:
    values = {"method": "GET", "path": "/v1/models", "status": 200, "tenant": "acme", "x": None}
    logger = logging.getLogger("tokenyard.test")
    record = logger.makeRecord(
        logger.name, logging.INFO, __file__, 1, Fields("", values, ("method", "path", "status")),
        (), None,
    )  # fmt: skip
    assert TextFormatter().format(record).endswith(" GET /v1/models 200 tenant=acme")
    out = json.loads(JsonFormatter().format(record))
    assert out["message"] == "GET /v1/models 200" and out["logger"] == "tokenyard.test"
    assert (out["status"], out["tenant"], out["x"]) == (200, "acme", None)


def test_an_unknown_log_level_is_one_clear_error() -> None:
    with pytest.raises(FatalError, match="unknown log level 'loud'"):
        setup_logging("loud")


def test_the_stats_line_reports_each_interval_and_quiets_when_idle() -> None:
    line = StatsLine("w1", 10.0, now=100.0)
    assert not line.due(109.9) and line.due(110.0)
    stats = EngineStats(steps=10, sequences_stepped=30, tokens_generated=300, prefill_tokens=50)
    level, fields = line.take(110.0, stats, running=3, waiting=2, jobs_done=7)
    assert level == logging.INFO
    assert str(fields) == (
        "stats running=3 waiting=2 prompt_tokens_per_s=5.0 generation_tokens_per_s=30.0 "
        "mean_batch=3.0 jobs_done=7 worker=w1"
    )  # no KV column: this engine never reported a KV cache; no prefix cache either
    level, fields = line.take(120.0, stats, running=0, waiting=0, jobs_done=7)
    assert level == logging.INFO  # the first idle interval still says so
    assert fields.values["generation_tokens_per_s"] == 0.0
    level, _ = line.take(130.0, stats, running=0, waiting=0, jobs_done=7)
    assert level == logging.DEBUG  # idle again: quiet at INFO
    busy = EngineStats(
        steps=11,
        sequences_stepped=31,
        tokens_generated=310,
        prefill_tokens=50,
        kv_cache_usage=0.125,
        prefix_cache_queries=8,
        prefix_cache_hits=2,
    )
    level, fields = line.take(135.0, busy, running=1, waiting=0, jobs_done=8)
    assert level == logging.INFO
    assert fields.values["generation_tokens_per_s"] == 2.0
    assert (fields.values["kv_usage_pct"], fields.values["prefix_hit_pct"]) == (12.5, 25.0)
    assert not StatsLine("w1", 0.0, now=0.0).due(1e9)  # 0: off


def test_job_timeline_orders_a_claim_begun_before_the_job_and_a_clock_behind() -> None:
    # the worker's claim was blocking 0.5 s before the gateway created the job
    at = tracing.job_timeline(
        created=100.0, claim=(99.5, 100.02), started=100.03, first=100.05, last=100.2,
        complete=(100.21, 100.22),
    )  # fmt: skip
    assert (at.created, at.picked, at.claimed) == (100.0, 100.0, 100.02)
    assert (at.started, at.first, at.last, at.complete_end) == (100.03, 100.05, 100.2, 100.22)
    # a worker whose clock is 1 s behind the gateway's: nothing dates before the creation
    skewed = tracing.job_timeline(
        created=100.0, claim=(99.0, 99.02), started=99.03, first=None, last=None,
        complete=(99.04, 99.05),
    )  # fmt: skip
    times = [skewed.created, skewed.picked, skewed.claimed, skewed.started or 0.0,
             skewed.complete_start, skewed.complete_end]  # fmt: skip
    assert times == sorted(times) and min(times) == 100.0
