"""Logging setup for every process: text or JSON lines, each carrying job and trace ids.

A log call names its job with `extra=job_fields(job_id, trace_context)`; a line logged inside
an OpenTelemetry span also carries that span's trace id. A line of named values (the gateway's
access line, the worker's stats line) is logged as `Fields`: `key=value`s in text, keys in JSON.

Every line of the process leaves through the one handler `setup_logging` installs, in its
format: libraries that print through a console handler of their own (transformers,
huggingface_hub) are made to propagate to it instead, `warnings` are logged, and the INFO
chatter of a few (httpx's line per request, transformers' batching manager) is DEBUG.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any

from tokenyard import tracing
from tokenyard.errors import FatalError

_IDS = ("job_id", "trace_id", "span_id")
# libraries whose INFO lines are routine chatter: one per upstream HTTP request (httpx), the
# batching manager's start and stop (transformers); shown at DEBUG
QUIETED = ("httpx", "ContinuousBatchingLogger")
# names this process in every line when several write to one stream (serve's workers)
LOG_NAME_ENV = "TOKENYARD_LOG_NAME"


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
        rest = (
            f"{k}={_text(v)}"
            for k, v in self.values.items()
            if v is not None and k not in self.head
        )
        return " ".join((self.headline(), *rest))


# whitespace (`\s` is str.isspace()'s set, all of Unicode) or a quote: the value is quoted
_QUOTED = re.compile(r'[\s"]')


def _text(value: Any) -> str:
    """A value as `key=value` shows it: quoted where it holds a space or a quote (a reason).
    One regex search, not a Python step per character: the access line has a dozen values."""
    text = str(value)
    if isinstance(value, str) and (not text or _QUOTED.search(text)):
        return json.dumps(text, ensure_ascii=False)
    return text


class IdsFilter(logging.Filter):
    """Fills trace_id/span_id from the current OpenTelemetry span when the call gave none."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "trace_id", None) is None:
            ids = tracing.current_ids()
            if ids is not None:
                record.trace_id, record.span_id = ids
        return True


class TextFormatter(logging.Formatter):
    def __init__(self, process: str | None = None) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if self.process:
            line = f"[{self.process}] {line}"
        ids = " ".join(f"{k}={getattr(record, k)}" for k in _IDS if getattr(record, k, None))
        return f"{line} [{ids}]" if ids else line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: ts, level, logger, message, the ids, and any exception;
    `process` (serve's `worker-2`) names the process where several share a stream."""

    def __init__(self, process: str | None = None) -> None:
        super().__init__()
        self.process = process

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
        if self.process:
            out["process"] = self.process
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


class _Quieted(logging.Filter):
    """A library's INFO line as DEBUG: kept only when the process logs at DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def _console(handler: logging.Handler) -> bool:
    """A plain handler printing to the terminal, as libraries add to their own loggers."""
    stream = getattr(handler, "stream", None)
    consoles = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    return type(handler) is logging.StreamHandler and any(stream is c for c in consoles)


class _LibraryLogger(logging.Logger):
    """Every logger made after `setup_logging`: a console handler of its own is refused, and a
    logger left with no handler propagates whatever it was told, so a library that imports
    after setup (transformers when the engine loads) still logs through ours."""

    def __init__(self, name: str, level: int | str = logging.NOTSET) -> None:
        self._propagate = True
        super().__init__(name, level)

    @property
    def propagate(self) -> bool:
        return self._propagate or not self.handlers

    @propagate.setter
    def propagate(self, value: bool) -> None:
        self._propagate = value

    def addHandler(self, hdlr: logging.Handler) -> None:
        if not _console(hdlr):
            super().addHandler(hdlr)


def _adopt_libraries() -> None:
    """Loggers made before setup (a library imported already) lose their console handlers
    and propagate; those made afterwards are `_LibraryLogger`s."""
    logging.setLoggerClass(_LibraryLogger)
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):  # a PlaceHolder: no logger by that name yet
            continue
        for handler in [h for h in logger.handlers if _console(h)]:
            logger.removeHandler(handler)
        if not logger.handlers:
            logger.propagate = True
    # vLLM configures its own handlers at import unless told not to
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    logging.captureWarnings(True)  # `warnings.warn` as a line of the py.warnings logger
    for name in QUIETED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Quieted) for f in logger.filters):
            logger.addFilter(_Quieted())


def setup_logging(
    level: str = "INFO", fmt: LogFormat | str = LogFormat.TEXT, process: str | None = None
) -> None:
    """Replace the root handlers with one stderr handler in the chosen format, through which
    every library's lines go too; `process` (default: TOKENYARD_LOG_NAME) leads each line."""
    name = level.upper()
    if name not in logging.getLevelNamesMapping():
        raise FatalError(f"unknown log level {level!r}: DEBUG, INFO, WARNING, ERROR or CRITICAL")
    process = process or os.environ.get(LOG_NAME_ENV) or None
    if process:
        process = process.replace("{pid}", str(os.getpid()))
    handler = logging.StreamHandler(sys.stderr)
    json_lines = LogFormat(fmt) is LogFormat.JSON
    handler.setFormatter(JsonFormatter(process) if json_lines else TextFormatter(process))
    handler.addFilter(IdsFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(name)
    # no format here shows a line's source, thread or multiprocessing name: a record skips
    # finding them (logging's own optimisation switches; ~4 of the ~16 µs an access line costs)
    logging._srcfile = None
    logging.logThreads = False
    logging.logMultiprocessing = False
    _adopt_libraries()


def json_logging() -> bool:
    """Whether this process logs JSON lines (`setup_logging` chose it)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
