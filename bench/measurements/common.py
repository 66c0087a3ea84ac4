"""What the measurements share: the sample plan, the figures one passes to another, the units."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MS = 1000.0
HEARTBEAT = 15.0  # the worker's default heartbeat interval (supervisor/worker/commands.py)


@dataclass(frozen=True)
class Plan:
    """Sample counts and windows: the full suite, or --quick for a smoke test."""

    quick: bool

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full

    @property
    def acks(self) -> int:
        return int(self.pick(200, 30))

    @property
    def cycles(self) -> int:
        return int(self.pick(10, 3))

    @property
    def adoptions(self) -> int:
        return int(self.pick(5, 2))

    @property
    def idle_seconds(self) -> float:
        return float(self.pick(60, 10))

    @property
    def heartbeat_seconds(self) -> int:
        return int(self.pick(180, 20))

    @property
    def cancels(self) -> int:
        return int(self.pick(5, 2))

    @property
    def scale_workers(self) -> int:
        return int(self.pick(20, 5))

    @property
    def scale_rounds(self) -> int:
        return int(self.pick(10, 2))

    @property
    def burst_rounds(self) -> int:
        return int(self.pick(5, 2))

    @property
    def scale_idle_seconds(self) -> float:
        return float(self.pick(15, 5))

    @property
    def slow_build(self) -> int:
        """ARG SLOW of the slow engine: longer than anything the bench waits for."""
        return self.heartbeat_seconds + 600


@dataclass
class Cycles:
    ready: list[float] = field(default_factory=list)
    ready_base: list[float] = field(default_factory=list)
    gone: list[float] = field(default_factory=list)
    stopped: list[float] = field(default_factory=list)
    stop_base: list[float] = field(default_factory=list)


@dataclass
class Shared:
    """Figures one measurement takes from another."""

    ack_p99: float | None = None
    idle_rss: float | None = None
    idle_base_rss: float | None = None
    cycles: Cycles | None = None
