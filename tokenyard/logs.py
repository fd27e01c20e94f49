"""Logging setup for every process: text or JSON lines, each carrying job and trace ids.

A log call names its job with `extra=job_fields(job_id, trace_context)`; a line logged inside
an OpenTelemetry span also carries that span's trace id. A line of named values (the gateway's
access line, the worker's stats line) is logged as `Fields`: `key=value`s in text, keys in JSON.
"""

from __future__ import annotations

import enum
import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from tokenyard import tracing
from tokenyard.errors import FatalError

_IDS = ("job_id", "trace_id", "span_id")


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"


def trace_id_of(trace_context: Mapping[str, str]) -> str | None:
    """The trace id of a W3C `traceparent` (version-traceid-spanid-flags), if well formed."""
    parts = trace_context.get("traceparent", "").split("-")
    if len(parts) == 4 and len(parts[1]) == 32:
        return parts[1]
    return None


def job_fields(job_id: str, trace_context: Mapping[str, str] | None = None) -> dict[str, str]:
    """`extra=` for a log call about one job."""
    fields = {"job_id": job_id}
    trace_id = trace_id_of(trace_context or {})
    if trace_id is not None:
        fields["trace_id"] = trace_id
    return fields


class Fields:
    """A log message of named values, rendered only when a handler emits it: text reads
    `title head... key=value ...` (None left out), JSON keeps every value under its own key."""

    __slots__ = ("head", "title", "values")

    def __init__(self, title: str, values: dict[str, Any], head: tuple[str, ...] = ()) -> None:
        self.title = title
        self.values = values
        self.head = head  # keys whose values lead the text bare, as an access log's do

    def headline(self) -> str:
        lead = [str(self.values[k]) for k in self.head]
        return " ".join([self.title, *lead] if self.title else lead)

    def __str__(self) -> str:
        rest = (f"{k}={v}" for k, v in self.values.items() if v is not None and k not in self.head)
        return " ".join((self.headline(), *rest))


class IdsFilter(logging.Filter):
    """Fills trace_id/span_id from the current OpenTelemetry span when the call gave none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "trace_id", None) is None:
            ids = tracing.current_ids()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = " ".join(f"{k}={getattr(record, k)}" for k in _IDS if getattr(record, k, None))
        return f"{line} [{ids}]" if ids else line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, message, the ids, and any exception."""

    def format(self, record: logging.LogRecord) -> str:
        fields = record.msg if isinstance(record.msg, Fields) else None
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage() if fields is None else fields.headline(),
            "pid": record.process,
        }
        if fields is not None:
            for key, value in fields.values.items():
                out.setdefault(key, value)  # never over ts, level, logger, message
        for key in _IDS:
            value = getattr(record, key, None)
            if value:
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str = "INFO", fmt: LogFormat | str = LogFormat.TEXT) -> None:
    """Replace the root handlers with one stderr handler in the chosen format."""
    name = level.upper()
    if name not in logging.getLevelNamesMapping():
        raise FatalError(f"unknown log level {level!r}: DEBUG, INFO, WARNING, ERROR or CRITICAL")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if LogFormat(fmt) is LogFormat.JSON else TextFormatter())
    handler.addFilter(IdsFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(name)
