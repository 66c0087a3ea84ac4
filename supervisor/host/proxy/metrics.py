"""The gateway's metrics, in a Prometheus registry of its own.

Requests by model, engine and outcome, running and waiting per engine (read from the admission
gates at each scrape), refusals by reason, the wait, the time to first token (by engine, model
and build) and the duration, and the engine's own token counts by model, engine and key id
(never a key). The probe's (gateway/prober.py): its outcomes and time to first token by
engine, model and build, and whether each model it probes is degraded.

A build label is the engine's version and the first 12 hex digits of its image id
(`0.32.0@fdb5bbc774b1`; `unknown` for what the engine's status.json does not name).

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

from supervisor.protocol.documents import FileSd, Status, TargetGroup, dump
from supervisor.protocol.files import ensure_dir, write_atomic

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
TELEMETRY_DIR: Final = "telemetry"  # the workers' file_sd directory, shared
TARGET_FILE: Final = "_gateway.json"
Outcome = Literal["ok", "engine_error", "engine_failed", "refused", "timed_out", "client_gone"]
# the wait is short or a start (minutes); the first token and the whole answer up to the deadline
_WAIT_BUCKETS: Final = (0.001, 0.01, 0.05, 0.25, 1, 5, 15, 30, 60, 180, 600, 1800)
TIME_BUCKETS: Final = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600, 1800)

Counts = Callable[[], Mapping[str, tuple[int, int]]]  # engine -> (running, waiting)
Degraded = Callable[[], Mapping[tuple[str, str], bool]]  # (engine, model) -> degraded
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


class _Probed(Collector):
    """Whether each model the probe marks is degraded (1) or not (0), at the scrape."""

    def __init__(self, degraded: Degraded) -> None:
        self._degraded = degraded

    @staticmethod
    def _family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            "lucia_gateway_probe_degraded",
            "1 while the model's last conclusive probe failed, per engine and model.",
            labels=["engine", "model"],
        )

    def describe(self) -> Iterator[Metric]:
        """The family's name, without asking for the marks (the registry asks at register)."""
        yield self._family()

    def collect(self) -> Iterator[Metric]:
        family = self._family()
        for (engine, model), degraded in sorted(self._degraded().items()):
            family.add_metric([engine, model], 1 if degraded else 0)
        yield family


def build_label(status: Status | None) -> str:
    """Pure: the build a metric names: `<engine version>@<image id's first 12 hex digits>`."""
    running = status.engine if status is not None else None
    if running is None:
        return "unknown"
    version = running.engine_version or "unknown"
    image = running.image_id.removeprefix("sha256:")[:12] or "unknown"
    return f"{version}@{image}"


class GatewayMetrics:
    """The gateway's own Prometheus metrics: requests, refusals, waits, times and tokens."""

    def __init__(self, counts: Counts, degraded: Degraded = dict) -> None:
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
            "Time from arrival to the answer's first byte, by engine, model and build.",
            ["engine", "model", "build"],
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
            "Prompt tokens, from the engine's own usage, by model, engine and key id.",
            ["model", "engine", "key"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "lucia_gateway_completion_tokens",
            "Completion tokens, from the engine's own usage, by model, engine and key id.",
            ["model", "engine", "key"],
            registry=r,
        )
        self.probes = Counter(
            "lucia_gateway_probes",
            "The gateway's probes of its engines, by engine, model, build and outcome.",
            ["engine", "model", "build", "outcome"],
            registry=r,
        )
        self.probe_ttft = Histogram(
            "lucia_gateway_probe_ttft_seconds",
            "A probe's time to its one token's answer, by engine, model and build.",
            ["engine", "model", "build"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        r.register(_Gates(counts))
        r.register(_Probed(degraded))
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

    def usage(self, model: str, engine: str, caller: str, usage: Mapping[str, Any] | None) -> None:
        """Count an answer's usage, when the engine said one (integers only); `caller`: the
        caller's key id."""
        if usage is None:
            return
        for key, counter in (
            ("prompt_tokens", self.prompt_tokens),
            ("completion_tokens", self.completion_tokens),
        ):
            value = usage.get(key)
            if type(value) is int and value >= 0:
                self.child(counter, model, engine, caller).inc(value)

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
