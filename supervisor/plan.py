"""Pure: (what is asked, what was seen, what this generation already did) -> the next step.

No I/O here. The worker observes, calls plan(), and carries the step out; then it observes again.
"""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import DesiredState, State
from .runtime import Container

FINGERPRINT = "lucia.fingerprint"  # container label: the run settings that need a restart


@dataclass(frozen=True)
class Memory:
    """What the worker knows about the generation it is applying. Forgotten on restart."""

    generation: int
    desired: DesiredState
    ready: str | None = None  # id of the container seen answering its ready path
    failure: str | None = None  # why this generation failed; it stays failed until a new one


@dataclass(frozen=True)
class Observed:
    container: Container | None
    missing: tuple[str, ...]  # prerequisites (checkout, images, ...) still to be made, in order
    image_id: str | None  # the image the container must run on, once it exists
    fingerprint: str = ""  # what else, when changed, needs a new container (engine-defined)


@dataclass(frozen=True)
class Prepare:
    what: str


@dataclass(frozen=True)
class Start:
    image_id: str


@dataclass(frozen=True)
class AwaitReady:
    container_id: str


@dataclass(frozen=True)
class Stop:
    container_id: str
    reason: str


@dataclass(frozen=True)
class Remove:
    container_id: str


@dataclass(frozen=True)
class Fail:
    message: str
    logs_of: str | None = None  # a container whose last log lines explain the failure


@dataclass(frozen=True)
class Settle:
    state: State


Step = Prepare | Start | AwaitReady | Stop | Remove | Fail | Settle


def exit_message(container: Container) -> str:
    if container.oom_killed:
        return f"exited with code {container.exit_code}: killed for using too much memory"
    return f"exited with code {container.exit_code}"


def plan(memory: Memory, observed: Observed) -> Step:
    container = observed.container
    if container is not None and not container.managed:
        return Fail(
            f"a container named {container.name} exists that lucia-supervisor did not create; "
            "remove or rename it, then request again"
        )
    if memory.desired == "stopped":
        if container is None:
            return Settle("stopped")
        if container.running:
            return Stop(container.id, "stop requested")
        return Remove(container.id)
    return _plan_running(memory, observed, container)


def _plan_running(memory: Memory, observed: Observed, container: Container | None) -> Step:
    if memory.failure is not None:
        return Settle("failed")
    if container is not None and not container.running:
        if memory.ready == container.id:
            return Fail(exit_message(container), logs_of=container.id)
        return Remove(container.id)  # left from before this generation: clear the name
    if observed.missing:
        return Prepare(observed.missing[0])  # a running engine keeps serving meanwhile
    if observed.image_id is None:
        return Fail("the engine image is missing after it was built")
    if container is None:
        return Start(observed.image_id)
    if container.image_id != observed.image_id:
        return Stop(container.id, "replacing: it runs on another image")
    if container.labels.get(FINGERPRINT, "") != observed.fingerprint:
        return Stop(container.id, "replacing: its run settings changed")
    if memory.ready != container.id:
        return AwaitReady(container.id)
    return Settle("running")
