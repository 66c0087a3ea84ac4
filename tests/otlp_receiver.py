"""A real OTLP/HTTP receiver for the tests, built on the protocol's own definitions.

Neither Debian nor PyPI carries the OpenTelemetry Collector or Jaeger here, so this is the
receiving side of OTLP/HTTP (binary protobuf) as its specification defines it, decoded with the
message classes `opentelemetry-proto` generates from the protocol's .proto files: POST
/v1/traces takes an `ExportTraceServiceRequest`, POST /v1/metrics an
`ExportMetricsServiceRequest`, each answered 200 with the empty response message. gzip and
deflate bodies are taken, as the spec allows. The raw bytes of every body are kept, so a test
can search all that was exported for text that must never be in it.

`hang=True` makes a receiver that reads every body and never answers (a receiver that is there
but stuck); a port nothing listens on is a receiver that is down.
"""

from __future__ import annotations

import contextlib
import gzip
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

PROTOBUF = "application/x-protobuf"


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: value_of(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span, as the receiver decoded it."""

    service: str
    scope: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str  # "" for a root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str


@dataclass(frozen=True)
class ReceivedPoint:
    """One data point of an exported metric: a sum's value or a histogram's count and sum."""

    scope: str
    metric: str
    unit: str
    attributes: dict[str, Any]
    value: float  # a sum's value; a histogram's sum
    count: int  # a histogram's count; 0 for a sum


class Receiver:
    """What one receiver got, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[bytes] = []  # every body as it came (decompressed)
        self.trace_requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metric_requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.posts = 0  # every POST, answered or not
        self.url = ""

    def spans(self) -> list[ReceivedSpan]:
        found: list[ReceivedSpan] = []
        with self.lock:
            requests = list(self.trace_requests)
        for request in requests:
            for resource_spans in request.resource_spans:
                service = attributes(resource_spans.resource.attributes).get("service.name", "")
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        found.append(
                            ReceivedSpan(
                                service=service,
                                scope=scope_spans.scope.name,
                                name=span.name,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_id=span.parent_span_id.hex(),
                                kind=span.kind,
                                start_ns=span.start_time_unix_nano,
                                end_ns=span.end_time_unix_nano,
                                attributes=attributes(span.attributes),
                                status_code=span.status.code,
                                status_message=span.status.message,
                            )
                        )
        return found

    def points(self) -> list[ReceivedPoint]:
        found: list[ReceivedPoint] = []
        with self.lock:
            requests = list(self.metric_requests)
        for request in requests:
            for resource_metrics in request.resource_metrics:
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        found.extend(_points(scope_metrics.scope.name, metric))
        return found

    def exported(self) -> bytes:
        with self.lock:
            return b"".join(self.bodies)


def _points(scope: str, metric: Any) -> list[ReceivedPoint]:
    """A sum's or a histogram's data points (the kinds the gateway exports)."""
    kind = metric.WhichOneof("data")
    if kind == "sum":
        return [
            ReceivedPoint(
                scope,
                metric.name,
                metric.unit,
                attributes(point.attributes),
                float(point.as_int if point.HasField("as_int") else point.as_double),
                0,
            )
            for point in metric.sum.data_points
        ]
    if kind == "histogram":
        return [
            ReceivedPoint(
                scope,
                metric.name,
                metric.unit,
                attributes(point.attributes),
                point.sum,
                point.count,
            )
            for point in metric.histogram.data_points
        ]
    return []


def _handler(receiver: Receiver, hang: threading.Event | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            return

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            encoding = (self.headers.get("Content-Encoding") or "").lower()
            if encoding == "gzip":
                raw = gzip.decompress(raw)
            elif encoding == "deflate":
                raw = zlib.decompress(raw)
            with receiver.lock:
                receiver.posts += 1
            if hang is not None:
                hang.wait()  # there, and stuck: the exporter's timeout is all that ends it
                return
            if self.path == "/v1/traces":
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(raw)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                with receiver.lock:
                    receiver.bodies.append(raw)
                    receiver.trace_requests.append(request)
            elif self.path == "/v1/metrics":
                metrics = metrics_service_pb2.ExportMetricsServiceRequest()
                metrics.ParseFromString(raw)
                answer = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                with receiver.lock:
                    receiver.bodies.append(raw)
                    receiver.metric_requests.append(metrics)
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", PROTOBUF)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

    return Handler


@contextlib.contextmanager
def receiving(address: str = "127.0.0.1", *, hang: bool = False) -> Iterator[Receiver]:
    """A receiver listening on `address` and a free port, its base URL in `url`."""
    receiver = Receiver()
    stuck = threading.Event() if hang else None
    server = ThreadingHTTPServer((address, 0), _handler(receiver, stuck))
    server.daemon_threads = True
    host = f"[{address}]" if ":" in address else address
    receiver.url = f"http://{host}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="otlp receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        if stuck is not None:
            stuck.set()
        server.shutdown()
        server.server_close()
        thread.join(10)
