"""OpenTelemetry for the gateway: a span per request and the meter Lucia.Inference, over OTLP.

Made only when `[tracing] endpoint` is set (spans.py says what a span holds); both signals are
exported over OTLP/HTTP.

A request only hands its ended spans and its figures to the SDK, in memory: the batch span
processor and the periodic metric reader export from threads of their own, so a receiver that
is slow, down or refusing never fails or holds a request (spans beyond its queue of 2,048 are
dropped). What the SDK logs (an export that failed, a full queue) goes to the journal, at most
once a minute for each kind of line.

The caller's W3C trace context is continued: the request's span is the child of its
traceparent (when valid), and the engine gets a traceparent naming the request's span.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Final

from aiohttp import web
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from supervisor import logs
from supervisor.host.gateway import spans
from supervisor.host.gateway.sections import TracingSettings
from supervisor.host.proxy.forward import Trace
from supervisor.host.proxy.metrics import TIME_BUCKETS
from supervisor.host.record.row import Row
from supervisor.host.web.refusal import Refusal
from supervisor.protocol import names
from supervisor.version import version

METER: Final = "Lucia.Inference"
TRACER: Final = "lucia.gateway"
CLOSE_S: Final = 5.0  # at a stop, what is left is exported for this long at most
SAID_EVERY_S: Final = 60.0  # one kind of SDK line goes to the journal this often at most
_QUIET: Final = frozenset({"ok", "client_gone"})  # outcomes that are no error of the span
log = logs.get("gateway")


@dataclass(slots=True)
class Open:
    """A request's span while it runs, and what its end needs: its row once the request was
    routed (None: refused before, or gone), the model as its engine knows it, the status."""

    span: Span
    offset_ns: int  # the wall clock's nanoseconds less the loop clock's
    row: Row | None = None
    model: str | None = None
    status: int | None = None

    def ns(self, loop_time: float) -> int:
        return round(loop_time * 1e9) + self.offset_ns


class _Journal(logging.Handler):
    """The SDK's own log lines into the journal, each kind at most once a minute (a receiver
    that is down would otherwise say so for every batch, and a full queue for every span)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._last: dict[tuple[str, object], float] = {}
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        kind = (record.name, record.msg)
        with self._lock:
            if now - self._last.get(kind, -SAID_EVERY_S) < SAID_EVERY_S:
                return
            self._last[kind] = now
        try:
            message = record.getMessage()
        except (TypeError, ValueError):
            message = str(record.msg)
        log.warning("tracing: the exporter says", detail=message, source=record.name)


class _Figures:
    """The meter's instruments: the Prometheus metrics' figures, by model and outcome."""

    def __init__(self, provider: MeterProvider) -> None:
        meter = provider.get_meter(METER, version())
        self.input_tokens = meter.create_counter(
            "lucia.inference.input_tokens", "{token}", "Prompt tokens, from the engine's usage."
        )
        self.cached_tokens = meter.create_counter(
            "lucia.inference.cached_tokens", "{token}", "Prompt tokens the engine's cache held."
        )
        self.output_tokens = meter.create_counter(
            "lucia.inference.output_tokens", "{token}", "Completion tokens, from the engine."
        )
        self.time_to_first_token = meter.create_histogram(
            "lucia.inference.time_to_first_token",
            "s",
            "Time from arrival to the answer's first byte.",
            explicit_bucket_boundaries_advisory=TIME_BUCKETS,
        )
        self.duration = meter.create_histogram(
            "lucia.inference.duration",
            "s",
            "Time from arrival to the answer's end.",
            explicit_bucket_boundaries_advisory=TIME_BUCKETS,
        )

    def add(self, row: Row, model: str, outcome: str) -> None:
        tags = {"model": model, "outcome": outcome}
        for counter, value in (
            (self.input_tokens, row.prompt_tokens),
            (self.cached_tokens, row.cached_tokens),
            (self.output_tokens, row.completion_tokens),
        ):
            if value:
                counter.add(value, tags)
        if row.ttft_s is not None:
            self.time_to_first_token.record(row.ttft_s, tags)
        if outcome != "refused":
            self.duration.record(row.duration_s, tags)


class Tracing:
    """The tracer and meter providers, their OTLP/HTTP exporters, and a request's span."""

    def __init__(self, settings: TracingSettings) -> None:
        resource = Resource.create(
            {SERVICE_NAME: settings.service_name, SERVICE_VERSION: version()}
        )
        timeout_ms = settings.timeout_s * 1000
        self._traces = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
            resource=resource,
            shutdown_on_exit=False,  # close() bounds the stop; an exit handler would not
        )
        self._traces.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(
                    endpoint=f"{settings.endpoint}/v1/traces", timeout=settings.timeout_s
                )
            )
        )
        reader = PeriodicExportingMetricReader(
            OTLPMetricExporter(f"{settings.endpoint}/v1/metrics", timeout=settings.timeout_s),
            export_interval_millis=settings.metrics_interval_s * 1000,
            export_timeout_millis=timeout_ms,
        )
        self._meters = MeterProvider([reader], resource=resource, shutdown_on_exit=False)
        self._figures = _Figures(self._meters)
        self._tracer = self._traces.get_tracer(TRACER, version())
        self._propagator = TraceContextTextMapPropagator()
        self.endpoint = settings.endpoint

    @staticmethod
    def quiet_the_sdk() -> None:
        """The SDK's loggers to the journal, throttled (_Journal), and never to stderr."""
        sdk = logging.getLogger("opentelemetry")
        if not any(isinstance(handler, _Journal) for handler in sdk.handlers):
            sdk.addHandler(_Journal())
        sdk.propagate = False

    def begin(self, headers: Mapping[str, str], path: str, trace: Trace) -> Open:
        """The request's span, from its arrival, the child of the caller's traceparent when
        valid; the engine is to get a traceparent naming it (`trace.context`)."""
        parent: Context = self._propagator.extract(headers)
        offset = time.time_ns() - round(trace.arrived * 1e9)
        span = self._tracer.start_span(
            f"POST {path}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=round(trace.arrived * 1e9) + offset,
            attributes={"http.request.method": "POST", "http.route": path},
        )
        own = span.get_span_context()
        context = {
            spans.TRACEPARENT: spans.traceparent(own.trace_id, own.span_id, own.trace_flags.sampled)
        }
        if own.trace_state:
            context[spans.TRACESTATE] = own.trace_state.to_header()
        trace.context = context
        return Open(span, offset)

    async def around(
        self,
        request: web.Request,
        trace: Trace,
        key_id: str,
        forward: Callable[[web.Request, Trace, Open], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        """Forward the request within its span, ended once everything else is done (its row
        recorded, its metrics counted), however the request ends: answered, refused (before it
        was routed too: a body, a model unknown) or its client gone."""
        done = self.begin(request.headers, request.path, trace)
        code: str | None = None
        try:
            response = await forward(request, trace, done)
            done.status = response.status
            return response
        except Refusal as refusal:
            code, done.status = refusal.code, refusal.status
            trace.outcome = trace.outcome or "refused"
            raise
        finally:
            self.finish(done, trace, key_id, asyncio.get_running_loop().time(), code)

    def finish(self, done: Open, trace: Trace, key_id: str, end: float, code: str | None) -> None:
        """End the request's span at `end` (the loop's clock) with its children and
        attributes, and count its figures when it was routed. `code`: a refusal's, when the
        request was refused before it had a row."""
        span, row = done.span, done.row
        outcome = trace.outcome or "client_gone"
        if row is not None and done.model is not None:
            self._figures.add(row, names.kept(done.model), outcome)
        if span.is_recording():
            within = set_span_in_context(span)
            for stretch in spans.stretches(trace, end):
                child = self._tracer.start_span(
                    stretch.name, context=within, start_time=done.ns(stretch.start)
                )
                child.end(end_time=done.ns(stretch.end))
            if row is not None:
                span.set_attributes(spans.row_attributes(row))
                said = row.outcome
            else:
                said = f"refused:{code}" if code is not None else outcome
                span.set_attributes({"lucia.key_id": key_id, "lucia.outcome": said})
            if done.status is not None:
                span.set_attribute("http.response.status_code", done.status)
            if outcome not in _QUIET:
                span.set_status(Status(StatusCode.ERROR, said))
        span.end(end_time=done.ns(end))

    def flush(self) -> None:
        """Export what is held now, in this thread (for the tests: a request never calls it)."""
        self._traces.force_flush()
        self._meters.force_flush()

    def _shutdown(self) -> None:
        self._traces.shutdown()
        self._meters.shutdown(timeout_millis=CLOSE_S * 1000)

    async def close(self, within_s: float = CLOSE_S) -> None:
        """Export what is left, for `within_s` at most: a thread of its own (a daemon, never
        joined at exit), so a receiver that does not answer cannot hold the stop."""
        closing = threading.Thread(target=self._shutdown, name="tracing close", daemon=True)
        closing.start()
        await asyncio.to_thread(closing.join, within_s)
        if closing.is_alive():
            log.warning(
                "tracing: not all spans and figures were exported at the stop",
                endpoint=self.endpoint,
                within_s=within_s,
            )
