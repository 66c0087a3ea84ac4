"""What every engine provides to the worker, and what a step is given to do its work.

An engine is looked at, never asked: `observe()` returns one `Observed`, and everything the
worker needs of the engine between two looks is in it. The rest of the protocol is what changes
the world: making a prerequisite, the checks before a start, one readiness probe, and settling
what a start left behind. `EngineInfo` is what the worker knows of an engine without a look.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final, Protocol

from supervisor.docker.spec import Container, RunSpec
from supervisor.protocol.documents import Capability, MemoryPlan, TargetGroup

if TYPE_CHECKING:
    from supervisor.memplan.guard import Guard
    from supervisor.memplan.need import EngineNeed

# the log lines read of a container that exited: a failed start's whole log, since its root
# cause is often far above its last line (worker/exits.py finds it)
EXIT_LOG_LINES: Final = 1000


class Prerequisite(Protocol):
    """Something the engine needs before its container can run; made by a Prepare step.
    Engines define them as frozen dataclasses."""

    @property
    def description(self) -> str: ...


@dataclass(frozen=True)
class Observed:
    """One look at the engine: its container, what it still needs, what it would run."""

    container: Container | None
    missing: tuple[Prerequisite, ...] = ()  # still to be made, in order
    spec: RunSpec | None = None  # what a container would be created with now, once it can be
    url: str | None = None  # where the engine answers, once its network exists
    targets: tuple[TargetGroup, ...] = ()  # the file_sd target groups while it serves
    notes: str = ""  # what the operator should know while it serves (files skipped...)
    log: tuple[str, ...] = ()  # the last log lines of a container that has exited
    version: str | None = None  # the version the running engine reports (vLLM's /version)
    models: tuple[str, ...] = ()  # the names it serves, in every state (status.json's models)
    failed: tuple[str, ...] = ()  # the models whose load failed (the worker's gauge)
    memory_plan: MemoryPlan | None = None  # the plan of a start now (status.json's memory)
    # while it runs: requests each loaded model holds at once (status.json's slots)
    slots: Mapping[str, int] = field(default_factory=dict)
    # what each served name serves, in every state (status.json's capabilities); left out: unknown
    capabilities: Mapping[str, tuple[Capability, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class StepContext:
    """A long step's link to the worker: report progress, notice a cancel."""

    cancel: threading.Event
    progress: Callable[[str], None]

    def sleep(self, seconds: float) -> bool:
        """Wait, waking at once on cancel; True when cancelled."""
        return self.cancel.wait(seconds)


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class Claimant:
    """How a start claims the machine's memory: the claims shared through the data directory,
    and what a start needs, read at its Check (the claims helper of the worker makes the claim)."""

    guard: Guard
    need: Callable[[], EngineNeed | None]


@dataclass(frozen=True)
class EngineInfo:
    """What the worker knows of an engine without a look: its names, its timings, its files."""

    kind: str
    container_name: str
    stop_grace: float
    ready_timeout: float
    poll_interval: float  # re-observe this often while settled (the exit monitor aside)
    private_files: tuple[Path, ...] = ()  # only its worker writes them (stale temps cleaned)
    models: tuple[str, ...] = ()  # the names it serves before any look (status.json's models)
    claim: Claimant | None = None  # None: its starts are not planned


class Engine(Protocol):
    """An engine: one look at it, how to make what it misses, the checks before a start, its
    readiness, and its own effects once a start's outcome is known."""

    @property
    def info(self) -> EngineInfo: ...

    def observe(self) -> Observed:
        """One look at the container, the prerequisites and the run spec (off the loop); every
        answer the worker uses travels in it."""

    def make(self, what: Prerequisite, ctx: StepContext) -> None:
        """Make one missing prerequisite (raises Permanent, Transient or Cancelled)."""

    def preflight(self, spec: RunSpec, replacing: str | None, ctx: StepContext) -> None:
        """Check, without stopping or starting anything, that this spec can start; raises
        Permanent with the reason when it cannot (a running engine then serves on). The memory
        claim is the worker's, after these checks."""

    def ready(self) -> bool:
        """One readiness probe; True when the engine answers."""

    def settle(self, running: str | None, started: bool) -> None:
        """After a start's memory claim is settled: started, with the container a Start made
        (None: it failed); or not started, when the generation no longer means to start what its
        Check passed, with the container still running (None: none)."""
