"""OpenTelemetry tracing, off by default: one trace per request, carried inside the job.

On when the standard variables ask for it (`OTEL_EXPORTER_OTLP_ENDPOINT`,
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_TRACES_EXPORTER=otlp|console`) and
`OTEL_SDK_DISABLED` is not true; the OTLP/HTTP exporter reads the rest of `OTEL_*` itself.
When off, every hook is one flag test: no SDK is imported and no span object is made.

The gateway continues the client's `traceparent` (or starts a trace), and writes the
context into `JobSpec.trace_context`; the worker records the job's queue wait, claim,
prefill, decode and completion as spans of that trace, from timestamps it kept anyway.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenyard.errors import FatalError
from tokenyard.messages import JobResult, JobSpec

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

_W3C = ("traceparent", "tracestate")


class _State:
    tracer: Tracer | None = None
    provider: TracerProvider | None = None


_state = _State()


def enabled() -> bool:
    return _state.tracer is not None


def wanted(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the OTEL_* environment asks for traces."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").lower()
    if exporter == "none":
        return False
    return bool(
        exporter in ("otlp", "console")
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure(service: str, exporter: SpanExporter | None = None, *, batch: bool = True) -> bool:
    """Turn tracing on for this process if the environment asks (or an exporter is given);
    returns whether it is on. A second call adds the exporter to the same provider."""
    if exporter is None and not wanted():
        return enabled()
    try:
        import opentelemetry.sdk  # noqa: F401
    except ImportError as exc:
        raise FatalError(
            "OTEL_* asks for traces but the OpenTelemetry SDK is not installed: "
            "pip install 'tokenyard[otel]'"
        ) from exc
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    if exporter is None:
        if os.environ.get("OTEL_TRACES_EXPORTER", "").lower() == "console":
            exporter = ConsoleSpanExporter()
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
    if _state.provider is None:
        name = os.environ.get("OTEL_SERVICE_NAME") or service
        _state.provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name}))
    processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
    _state.provider.add_span_processor(processor)
    _state.tracer = _state.provider.get_tracer("tokenyard")
    return True


def shutdown() -> None:
    """Flush and stop exporting; tracing is off afterwards."""
    provider, _state.provider, _state.tracer = _state.provider, None, None
    if provider is not None:
        provider.shutdown()


def current_ids() -> tuple[str, str] | None:
    """(trace id, span id) of the current span, for log lines; None when off or outside one."""
    if _state.tracer is None:
        return None
    from opentelemetry import trace

    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


# -- gateway -------------------------------------------------------------------------------
_OFF: contextlib.nullcontext[None] = contextlib.nullcontext()  # reusable and reentrant


# Request spans begun in this request's task end when its response has gone (see `hold`).
_held: ContextVar[list[Span] | None] = ContextVar("tokenyard_held_spans", default=None)


def server_span(name: str, headers: Mapping[str, str]) -> AbstractContextManager[Any]:
    """The request's span, continuing the caller's `traceparent` when it sent one; after
    `hold`, it ends with the response rather than with the handler."""
    tracer = _state.tracer
    if tracer is None:
        return _OFF
    from opentelemetry.propagate import extract
    from opentelemetry.trace import SpanKind

    parent = extract({k: headers[k] for k in _W3C if k in headers})
    span = tracer.start_span(name, context=parent, kind=SpanKind.SERVER)
    return _current_until_end(span, _held.get())


@contextlib.contextmanager
def _current_until_end(span: Span, held: list[Span] | None) -> Iterator[Span]:
    from opentelemetry.trace import use_span

    try:
        with use_span(span, end_on_exit=False, record_exception=True):
            yield span
    finally:
        if held is None:
            span.end()
        else:
            held.append(span)


class Held:
    """Request spans waiting for their response to end (see `hold`)."""

    __slots__ = ("spans", "token")

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.token = _held.set(self.spans)


def hold() -> Held | None:
    """For the HTTP edge, as a request comes in: its request spans end at `release`, once the
    response has gone. A handler returns a stream before its first byte, so a span ended with
    the handler would say a streamed call took a few milliseconds, and its job's spans would
    outlive it. None (one test) when tracing is off."""
    return None if _state.tracer is None else Held()


def release(held: Held) -> None:
    _held.reset(held.token)
    for span in held.spans:
        span.end()


def span(name: str, **attributes: Any) -> AbstractContextManager[Span | None]:
    """A child of the current span; nothing when off."""
    tracer = _state.tracer
    if tracer is None:
        return _OFF
    return tracer.start_as_current_span(name, attributes=attributes)


def carry(spec: JobSpec, headers: Mapping[str, str]) -> None:
    """Put the trace context into the job. When off, a caller's own `traceparent` still rides
    along verbatim, so the worker's log lines name the caller's trace."""
    if _state.tracer is None:
        if "traceparent" in headers:
            spec.trace_context = {k: headers[k] for k in _W3C if k in headers}
        return
    from opentelemetry.propagate import inject

    carrier: dict[str, str] = {}
    inject(carrier)
    spec.trace_context = carrier


# -- worker --------------------------------------------------------------------------------
@dataclass
class _Times:
    claim_start: float
    claim_end: float
    started: float | None = None  # handed to the engine


class JobSpans:
    """A worker's record of its traced jobs' times; spans are emitted when a job settles.

    Times are unix seconds; the scheduler's token times (monotonic) are converted on the way.
    """

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._times: dict[str, _Times] = {}

    def claimed(self, specs: Sequence[JobSpec], start: float, end: float) -> None:
        for spec in specs:
            if spec.trace_context:
                self._times[spec.id] = _Times(start, end)

    def started(self, job_id: str) -> None:
        times = self._times.get(job_id)
        if times is not None:
            times.started = time.time()

    def forget(self, job_id: str) -> None:
        self._times.pop(job_id, None)

    def settled(
        self,
        items: Sequence[tuple[JobSpec, JobResult, float | None, float | None]],
        accepted: Sequence[bool],
        start: float,
        end: float,
    ) -> None:
        """Emit the spans of jobs whose result was written (or fenced) between start and end;
        each item is (spec, result, first token, last token), token times monotonic."""
        tracer = _state.tracer
        if tracer is None:
            self._times.clear()
            return
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        to_wall = time.time() - time.monotonic()
        for (spec, result, first, last), ours in zip(items, accepted, strict=True):
            times = self._times.pop(spec.id, None)
            if times is None or not spec.trace_context:
                continue
            parent = extract(spec.trace_context)
            at = job_timeline(
                created=spec.created_at,
                claim=(times.claim_start, times.claim_end),
                started=times.started,
                first=None if first is None else first + to_wall,
                last=None if last is None else last + to_wall,
                complete=(start, end),
            )
            ns = _ns
            tracer.start_span("tokenyard.queue_wait", parent, start_time=ns(at.created)).end(
                ns(at.picked)
            )
            attrs: dict[str, str | int | bool] = {
                "tokenyard.job_id": spec.id,
                "tokenyard.model": spec.model,
                "tokenyard.worker": self.worker,
                "tokenyard.attempt": spec.attempt,
                "tokenyard.status": result.status.value,
                "tokenyard.prompt_tokens": result.prompt_tokens,
                "tokenyard.completion_tokens": result.completion_tokens,
                "tokenyard.fenced": not ours,
            }
            job = tracer.start_span(
                "tokenyard.job",
                parent,
                kind=SpanKind.CONSUMER,
                attributes=attrs,
                start_time=ns(at.picked),
            )
            inside = set_span_in_context(job)
            tracer.start_span("tokenyard.claim", inside, start_time=ns(at.picked)).end(
                ns(at.claimed)
            )
            if at.started is not None:
                prefill_end = at.complete_start if at.first is None else at.first
                tracer.start_span("tokenyard.prefill", inside, start_time=ns(at.started)).end(
                    ns(prefill_end)
                )
                if at.first is not None and at.last is not None:
                    tracer.start_span("tokenyard.decode", inside, start_time=ns(at.first)).end(
                        ns(at.last)
                    )
            tracer.start_span("tokenyard.complete", inside, start_time=ns(at.complete_start)).end(
                ns(at.complete_end)
            )
            if result.error or not ours:
                job.set_status(Status(StatusCode.ERROR, result.error or "lease lost"))
            job.end(ns(at.complete_end))


@dataclass(frozen=True)
class Timeline:
    """One delivery of a job, in the order it happened; unix seconds."""

    created: float  # admitted at the gateway
    picked: float  # delivered to this worker: the queue wait ends, the job's span begins
    claimed: float  # the claim call returned
    started: float | None  # handed to the engine (None: it never ran)
    first: float | None  # first and last token
    last: float | None
    complete_start: float  # the completion's write
    complete_end: float


def job_timeline(
    *,
    created: float,
    claim: tuple[float, float],
    started: float | None,
    first: float | None,
    last: float | None,
    complete: tuple[float, float],
) -> Timeline:
    """The spans' times, each no earlier than the one before, so every child lies inside its
    parent and no span has a negative length.

    Two readings break that order otherwise. A claim is a blocking read: an idle worker starts
    it before the job exists, so its start is not when the job was picked (a queue wait of
    -476 ms when the span ended there): the job is picked at the later of the two. And
    `created` is the gateway's clock, the rest the worker's: a worker whose clock runs behind
    would date its spans before the request that caused them, so they start no earlier than
    the job's creation, which lies inside the gateway's span.
    """
    picked = max(created, claim[0])
    claimed = max(picked, claim[1])
    started = None if started is None else max(claimed, started)
    floor = claimed if started is None else started
    first = None if first is None else max(floor, first)
    last = None if last is None or first is None else max(first, last)
    complete_start = max(t for t in (floor, first, last, complete[0]) if t is not None)
    return Timeline(
        created=created,
        picked=picked,
        claimed=claimed,
        started=started,
        first=first,
        last=last,
        complete_start=complete_start,
        complete_end=max(complete_start, complete[1]),
    )


def _ns(unix_s: float) -> int:
    return int(unix_s * 1e9)
