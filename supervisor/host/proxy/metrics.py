"""The gateway's metrics, in a Prometheus registry of its own.

Requests by model, engine and outcome, running and waiting per engine (read from the admission
gates at each scrape), refusals by reason, the wait, the time to first token and the duration,
and the engine's own token counts.

Also its file_sd target, `<data>/telemetry/_gateway.json` (no engine name starts with `_`),
written atomically and only when it changes, as the workers write theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from supervisor.protocol.documents import FileSd, TargetGroup, dump
from supervisor.protocol.files import ensure_dir, write_atomic

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
TELEMETRY_DIR: Final = "telemetry"  # the workers' file_sd directory, shared
TARGET_FILE: Final = "_gateway.json"
Outcome = Literal["ok", "engine_error", "engine_failed", "refused", "timed_out", "client_gone"]
# the wait is short or a start (minutes); the first token and the whole answer up to the deadline
_WAIT_BUCKETS: Final = (0.001, 0.01, 0.05, 0.25, 1, 5, 15, 30, 60, 180, 600, 1800)
TIME_BUCKETS: Final = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600, 1800)

Counts = Callable[[], Mapping[str, tuple[int, int]]]  # engine -> (running, waiting)
M = TypeVar("M", bound=MetricWrapperBase)


class _Gates(Collector):
    """Running and waiting per engine, as the gates hold them at the scrape."""

    def __init__(self, counts: Counts) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "lucia_gateway_running", "Requests forwarded now, per engine.", labels=["engine"]
        )
        waiting = GaugeMetricFamily(
            "lucia_gateway_waiting",
            "Requests held for a slot or a start, per engine.",
            labels=["engine"],
        )
        for engine, (run, wait) in sorted(self._counts().items()):
            running.add_metric([engine], run)
            waiting.add_metric([engine], wait)
        yield running
        yield waiting


class GatewayMetrics:
    """The gateway's own Prometheus metrics: requests, refusals, waits, times and tokens."""

    def __init__(self, counts: Counts) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "lucia_gateway_requests",
            "Forwarded requests by model, engine and outcome.",
            ["model", "engine", "outcome"],
            registry=r,
        )
        self.refusals = Counter(
            "lucia_gateway_refusals",
            "Requests refused by the gateway, by reason.",
            ["reason"],
            registry=r,
        )
        self.wait = Histogram(
            "lucia_gateway_wait_seconds",
            "Time from arrival to a running slot.",
            ["engine"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "lucia_gateway_ttft_seconds",
            "Time from arrival to the answer's first byte.",
            ["engine"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "lucia_gateway_duration_seconds",
            "Time from arrival to the answer's end.",
            ["engine"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "lucia_gateway_prompt_tokens",
            "Prompt tokens, from the engine's own usage.",
            ["model", "engine"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "lucia_gateway_completion_tokens",
            "Completion tokens, from the engine's own usage.",
            ["model", "engine"],
            registry=r,
        )
        r.register(_Gates(counts))
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def child(self, metric: M, *values: str) -> M:
        """`metric.labels(*values)` (in the order of its label names), kept: a request's
        metrics cost a dictionary lookup each, not the client's label checks."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason=reason).inc()

    def usage(self, model: str, engine: str, usage: Mapping[str, Any] | None) -> None:
        """Count an answer's usage, when the engine said one (integers only)."""
        if usage is None:
            return
        for key, counter in (
            ("prompt_tokens", self.prompt_tokens),
            ("completion_tokens", self.completion_tokens),
        ):
            value = usage.get(key)
            if type(value) is int and value >= 0:
                self.child(counter, model, engine).inc(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def target(address: str, port: int, tls: bool) -> TargetGroup:
    """Pure: where Prometheus scrapes the gateway (a wildcard address: on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(address, address)  # noqa: S104
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    labels = {"service": "lucia-gateway", "__scheme__": "https" if tls else "http"}
    return TargetGroup(targets=[where], labels=labels)


def publish_target(data_dir: Path, group: TargetGroup) -> Path:
    """Write the gateway's file_sd file atomically, when it changed; its path."""
    directory = ensure_dir(data_dir / TELEMETRY_DIR, mode=0o755)
    path = directory / TARGET_FILE
    data = dump(FileSd([group]))
    try:
        if path.read_bytes() == data:
            return path
    except OSError:
        pass
    write_atomic(path, data, mode=0o644)
    return path
