"""What every engine module provides, and what a step is given to do its work."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

from supervisor.docker.spec import Container, RunSpec
from supervisor.protocol.documents import MemoryPlan, TargetGroup

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
    memory: MemoryPlan | None = None  # the plan of a start now (status.json's memory)
    # while it runs: requests each loaded model holds at once (status.json's slots)
    slots: Mapping[str, int] = field(default_factory=dict)


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


class Engine(Protocol):
    """An engine: observed prerequisites, how to make each, and how its container runs."""

    kind: str
    container_name: str
    stop_grace: float
    ready_timeout: float
    poll_interval: float  # re-observe this often while settled (the exit monitor aside)

    def observe(self) -> Observed:
        """One look at the container, the prerequisites and the run spec (off the loop)."""

    def make(self, what: Prerequisite, ctx: StepContext) -> None:
        """Make one missing prerequisite (raises Permanent, Transient or Cancelled)."""

    def preflight(self, spec: RunSpec, replacing: str | None, ctx: StepContext) -> None:
        """Check, without stopping or starting anything, that this spec can start; raises
        Permanent with the reason when it cannot (a running engine then serves on)."""

    def started(self, container_id: str | None) -> None:
        """After a Start step: the container it made (its memory claim now holds while it
        runs), or None when the start failed (the claim is dropped)."""

    def abandoned(self, running: str | None) -> None:
        """The generation no longer means to start what its Check passed: a claim that Check
        made holds for the running container (running), or is dropped."""

    def planned_memory(self) -> tuple[int, int] | None:
        """(need, limit) in bytes at the last memory check; None before one."""

    def ready(self) -> bool:
        """One readiness probe; True when the engine answers."""

    def served_models(self) -> tuple[str, ...]:
        """The model names a client asks this engine for, in every state, from the recipe or
        what the worker made of it (never from the running engine): status.json's models."""

    def failed_models(self) -> tuple[str, ...]:
        """The models whose load failed, as the last observation saw (the worker's gauge)."""

    def private_files(self) -> tuple[Path, ...]:
        """Files only this engine's worker writes (their stale temp files are cleaned)."""
