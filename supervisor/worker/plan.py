"""Pure: (the request, what was observed, what this generation already did) -> one Decision.

The decision is whole: the next step, what status.json says and what the file_sd file holds. The
worker observes off its loop, calls plan(), writes what the decision says and runs its step; it
decides nothing itself. No I/O here, and no Docker: the container is the project's own value.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from supervisor.docker import labels
from supervisor.docker.spec import Container, RunSpec, changed_settings
from supervisor.engines.base import Observed, Prerequisite
from supervisor.protocol.documents import (
    DesiredFile,
    DesiredState,
    RunningEngine,
    State,
    TargetGroup,
)

UNREQUESTED: Final = "no valid request in desired.json; the engine is left as it is"
REFUSED: Final = "request refused: "


@dataclass(frozen=True)
class Memory:
    """What the worker knows about the generation it is applying. Forgotten on restart."""

    generation: int
    desired: DesiredState
    ready: str | None = None  # id of the container seen answering its ready path
    failure: str | None = None  # why this generation failed; it stays failed until a new one
    checked: str | None = None  # the fingerprint of the run spec whose preflight passed


@dataclass(frozen=True)
class Prepare:
    what: Prerequisite


@dataclass(frozen=True)
class Check:
    """Before anything is stopped or started: can this spec start? (image, port, memory, the
    engine's own argument check). A failure leaves a running engine serving."""

    spec: RunSpec
    replacing: str | None = None  # the container a pass would replace


@dataclass(frozen=True)
class Start:
    spec: RunSpec


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


Step = Prepare | Check | Start | AwaitReady | Stop | Remove


@dataclass(frozen=True)
class Answer:
    """What status.json says (the worker adds the times, the refusal and the heartbeat)."""

    generation: int
    state: State
    message: str
    url: str | None = None
    engine: RunningEngine | None = None


@dataclass(frozen=True)
class Decision:
    memory: Memory | None
    answer: Answer
    targets: tuple[TargetGroup, ...] = ()
    step: Step | None = None


def describe(step: Step) -> str:
    """The status message while a step runs, before its own progress arrives."""
    match step:
        case Prepare(what):
            return f"preparing: {what.description}"
        case Check():
            return "checking that the engine can start"
        case Start():
            return "starting the engine container"
        case AwaitReady():
            return "waiting for the engine to answer"
        case Stop(_, reason):
            return f"stopping the engine container ({reason})"
        case Remove():
            return "removing the old engine container"


def cancellable(step: Step) -> bool:
    """Stops and starts are short and must not be left half-done; the rest is interrupted."""
    return isinstance(step, Prepare | Check | AwaitReady)


def exit_message(container: Container) -> str:
    if container.oom_killed:
        return f"exited with code {container.exit_code}: killed for using too much memory"
    return f"exited with code {container.exit_code}"


def running_engine(container: Container) -> RunningEngine:
    """What runs, as the container's own labels recorded it when it was created."""
    found = container.labels
    return RunningEngine(
        image=found.get(labels.IMAGE_REF, ""),
        image_id=container.image_id,
        container_id=container.id,
        recipe_commit=found.get(labels.RECIPE_COMMIT),
        model=found.get(labels.MODEL, ""),
        model_revision=found.get(labels.MODEL_REVISION),
    )


# -- a new desired.json ------------------------------------------------------------------------


def accept(memory: Memory | None, desired: DesiredFile) -> Memory | None:
    """The memory for a request read from desired.json; None when it asks nothing new.

    Asking again for what already serves keeps the container seen answering (no new readiness
    probe); a failure is never carried over, so a new request retries."""
    if memory is not None and (memory.generation, memory.desired) == (
        desired.generation,
        desired.desired,
    ):
        return None
    ready = None
    if memory is not None and memory.desired == desired.desired and memory.failure is None:
        ready = memory.ready
    return Memory(desired.generation, desired.desired, ready=ready)


def acknowledge(memory: Memory, previous: Decision | None) -> Decision:
    """Answer a new generation at once, before any work: starting or stopping. A re-request
    of a serving engine keeps its Prometheus target: the engine goes on serving."""
    state: State = "starting" if memory.desired == "running" else "stopping"
    targets = previous.targets if previous is not None and memory.ready is not None else ()
    return Decision(
        memory,
        Answer(memory.generation, state, f"acknowledged: {memory.desired} requested"),
        targets,
    )


def shown(answer: Answer, refused: str | None) -> Answer:
    """A refused desired.json is named in a settled answer; a working one keeps its progress."""
    if refused and answer.state in ("running", "stopped", "failed"):
        return replace(answer, message=REFUSED + refused)
    return answer


# -- what to do next ---------------------------------------------------------------------------


def plan(memory: Memory | None, observed: Observed) -> Decision:
    container = observed.container
    if memory is None:
        state: State = "running" if container is not None and container.running else "stopped"
        return Decision(None, Answer(0, state, UNREQUESTED))
    if container is not None and not container.managed:
        return failed(
            memory,
            f"a container named {container.name} exists that lucia-supervisor did not create; "
            "remove or rename it, then request again",
        )
    if memory.desired == "stopped":
        if container is None:
            return Decision(memory, Answer(memory.generation, "stopped", "stopped"))
        if container.running:
            return _working(memory, Stop(container.id, "stop requested"))
        return _working(memory, Remove(container.id))
    return _plan_running(memory, observed, container)


def _plan_running(memory: Memory, observed: Observed, container: Container | None) -> Decision:
    if memory.failure is not None:
        return Decision(memory, Answer(memory.generation, "failed", memory.failure))
    if container is not None and not container.running:
        if memory.ready == container.id:
            tail = f": {observed.tail}" if observed.tail else ""
            return failed(memory, exit_message(container) + tail)
        return _working(memory, Remove(container.id))  # left from before: clear the name
    serving = container is not None and container.id == memory.ready
    if observed.missing:
        step = Prepare(observed.missing[0])
        if container is not None:  # a library re-sync or a build: a serving engine serves on
            return _serving_or_working(memory, observed, container, step)
        return _working(memory, step)
    spec = observed.spec
    if spec is None:
        return failed(memory, "the engine image is missing after it was built")
    checked = memory.checked == spec.fingerprint()
    if container is None:
        return _working(memory, Start(spec) if checked else Check(spec))
    reason = _replacing(container, spec)
    if reason is not None:
        if not checked:  # a replacement that cannot start never stops the running engine
            return _serving_or_working(memory, observed, container, Check(spec, container.id))
        return _working(memory, Stop(container.id, reason))
    if not serving:
        return _working(memory, AwaitReady(container.id))
    message = f"serving at {observed.url}" + (f"; {observed.notes}" if observed.notes else "")
    return _serving(memory, observed, container, message)


def _replacing(container: Container, spec: RunSpec) -> str | None:
    """Why this container is not what the spec says, or None when it is."""
    if container.image_id != spec.image:
        return "replacing: it runs on another image"
    changed = changed_settings(container.labels.get(labels.FINGERPRINT, ""), spec.fingerprint())
    return f"replacing: its {', '.join(changed)} changed" if changed else None


def _serving_or_working(
    memory: Memory, observed: Observed, container: Container, step: Step
) -> Decision:
    if container.id == memory.ready:
        return _serving(memory, observed, container, describe(step), step)
    return _working(memory, step)


def _working(memory: Memory, step: Step) -> Decision:
    state: State = "starting" if memory.desired == "running" else "stopping"
    return Decision(memory, Answer(memory.generation, state, describe(step)), step=step)


def _serving(
    memory: Memory, observed: Observed, container: Container, message: str, step: Step | None = None
) -> Decision:
    answer = Answer(memory.generation, "running", message, observed.url, running_engine(container))
    return Decision(memory, answer, observed.targets, step)


def failed(memory: Memory, reason: str) -> Decision:
    """The generation is failed until a new request: nothing is started or stopped for it."""
    return Decision(replace(memory, failure=reason), Answer(memory.generation, "failed", reason))


def unobserved(memory: Memory | None, reason: str) -> Decision:
    """Docker could not be asked (it is down): no step, and no claim that anything serves."""
    if memory is None:
        return Decision(None, Answer(0, "failed", f"cannot observe the engine: {reason}"))
    state: State = "starting" if memory.desired == "running" else "stopping"
    return Decision(memory, Answer(memory.generation, state, reason))


def stalled(previous: Decision, reason: str) -> Decision:
    """Docker did not answer in time: nothing is known to have changed, so the last answer
    stands, saying why it is not fresh."""
    return replace(previous, answer=replace(previous.answer, message=reason), step=None)


def means_to_start(memory: Memory | None) -> bool:
    """Whether this generation still means to start the spec its Check passed, so that what
    the Check claimed (its memory) is still wanted: a stop, a failure or a newer request ends
    that, and a newer request's own Check claims again."""
    return (
        memory is not None
        and memory.desired == "running"
        and memory.failure is None
        and memory.checked is not None
    )


# -- a step has ended --------------------------------------------------------------------------


def conclude(memory: Memory, step: Step, error: str | None) -> Memory:
    """What this generation has now done: a container seen answering, or a failure."""
    if error is not None:
        return replace(memory, failure=error)
    if isinstance(step, AwaitReady):
        return replace(memory, ready=step.container_id)
    if isinstance(step, Check):
        return replace(memory, checked=step.spec.fingerprint())
    return memory
