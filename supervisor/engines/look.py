"""One look at an engine as one value, and the prerequisites a look names.

What it still needs, the image it would run on, and what the look found; the kind's own part
rides along in `own`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from supervisor.docker.spec import Container, Image, RunSpec
from supervisor.engines.base import Endpoint, Prerequisite
from supervisor.protocol.documents import MemoryPlan


@dataclass(frozen=True)
class Network:
    """The bridge network whose gateway gets the engine's port."""

    name: str

    @property
    def description(self) -> str:
        return f"creating the Docker network {self.name}"


@dataclass(frozen=True)
class PulledImage:
    ref: str

    @property
    def description(self) -> str:
        return f"pulling {self.ref}"


@dataclass(frozen=True)
class EngineImage:
    """The image the container runs on: the reference it was resolved from, and its id."""

    ref: str
    image: Image


@dataclass(frozen=True)
class Prerequisites:
    """What is still to be made before the container can run (in order), and the image it
    runs on once that exists."""

    missing: tuple[Prerequisite, ...] = ()
    image: EngineImage | None = None


P = TypeVar("P", bound=Prerequisites)


@dataclass(frozen=True)
class Look(Generic[P]):
    """One look at the engine, as one value: its container, where it answers, what it still
    needs and the spec it would run; own is the kind's prerequisites with whatever else its look
    read (the router's /models and library, vLLM's namespace). Targets, notes, models and slots
    are pure functions of it, so no answer depends on the order it is asked in."""

    container: Container | None
    endpoint: Endpoint | None  # where it is published, else where it would be
    missing: tuple[Prerequisite, ...]
    spec: RunSpec | None
    own: P
    log: tuple[str, ...] = ()
    memory_plan: MemoryPlan | None = None

    @property
    def running(self) -> bool:
        """A container of ours runs."""
        container = self.container
        return container is not None and container.running and container.managed
