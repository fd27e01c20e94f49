"""Log formats, the OTEL_* switch, and CLI settings precedence (flag > environment > default)."""

from __future__ import annotations

import io
import json
import logging

import pytest

from tokenyard import tracing
from tokenyard.cli.app import _gateway_settings
from tokenyard.logs import JsonFormatter, LogFormat, TextFormatter, job_fields, setup_logging

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


def test_setup_logging_json_writes_one_object_a_line(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        setup_logging("info", LogFormat.JSON)
        logging.getLogger("x").info("hello", extra=job_fields("j2"))
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    [line] = stream.getvalue().splitlines()
    assert json.loads(line)["job_id"] == "j2"


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
