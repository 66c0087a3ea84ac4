"""The Prometheus side: the file_sd file for the engine, and the worker's own metrics."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from supervisor.protocol import files
from supervisor.protocol.documents import STATES, FileSd, State, TargetGroup, dump

TELEMETRY_DIR: Final = "telemetry"


class FileSdWriter:
    """<data>/telemetry/<name>.json: the engine's target groups while it runs, [] otherwise.

    Written atomically, and only when its content changes, so Prometheus never re-reads for
    nothing and never sees half a file.
    """

    def __init__(self, data_dir: Path, name: str) -> None:
        # Prometheus runs as its own user: the directory and its files are world-readable and
        # hold nothing but target addresses and labels
        self.path = files.ensure_dir(data_dir / TELEMETRY_DIR, mode=0o755) / f"{name}.json"
        self._last: bytes | None = None

    def publish(self, groups: Sequence[TargetGroup]) -> bool:
        data = dump(FileSd(list(groups)))
        if self._last is None:
            try:
                self._last = self.path.read_bytes()
            except OSError:
                self._last = b""
        if data == self._last:
            return False
        files.write_atomic(self.path, data, mode=0o644)
        self._last = data
        return True


class WorkerMetrics:
    """The worker's own metrics, in a registry of its own (no process-global state)."""

    def __init__(self, name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.reconciles = Counter(
            "lucia_worker_reconciles", "Reconcile passes (observe, plan).", registry=self.registry
        )
        self.failures = Counter(
            "lucia_worker_failures", "Failed steps, by reason.", ["reason"], registry=self.registry
        )
        self.state = Gauge(
            "lucia_worker_state",
            "1 for the engine's current state.",
            ["state"],
            registry=self.registry,
        )
        self.step_seconds = Histogram(
            "lucia_worker_step_seconds",
            "Duration of worker steps.",
            ["step"],
            buckets=(0.1, 0.5, 1, 5, 15, 60, 300, 900, 1800, 3600),
            registry=self.registry,
        )
        self.heartbeat = Gauge(
            "lucia_worker_last_heartbeat_seconds",
            "Unix time of the last status write.",
            registry=self.registry,
        )
        self.info = Gauge(
            "lucia_worker_info",
            "The engine this worker supervises.",
            ["name"],
            registry=self.registry,
        )
        self.info.labels(name=name).set(1)
        self.memory_need = Gauge(
            "lucia_worker_memory_need_bytes",
            "What the engine's start needs by the memory plan (at its last check).",
            registry=self.registry,
        )
        self.memory_limit = Gauge(
            "lucia_worker_memory_limit_bytes",
            "The memory limit the plan divides (at the last check).",
            registry=self.registry,
        )
        self.model_load_failed = Gauge(
            "lucia_router_model_load_failed",
            "1 for a router model whose last load failed.",
            ["model"],
            registry=self.registry,
        )
        self._failed: frozenset[str] = frozenset()

    def set_load_failed(self, models: Sequence[str]) -> None:
        """The failed models of the latest observation; a model that loads again is dropped."""
        now = frozenset(models)
        for model in self._failed - now:
            self.model_load_failed.remove(model)
        for model in now:
            self.model_load_failed.labels(model=model).set(1)
        self._failed = now

    def set_state(self, current: State) -> None:
        for state in STATES:
            self.state.labels(state=state).set(1 if state == current else 0)

    def serve(self, port: int) -> None:
        """Serve on loopback only: the worker's metrics are not for the LAN."""
        start_http_server(port, addr="127.0.0.1", registry=self.registry)
