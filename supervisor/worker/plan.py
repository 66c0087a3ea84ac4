"""Pure: (the request, what was observed, what this generation already did) -> one Decision.

The decision is whole: the next step, what status.json says and what the file_sd file holds. The
worker observes off its loop, calls plan(), writes what the decision says and runs its step; it
decides nothing itself. No I/O here, and no Docker: the container is the project's own value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Final

from supervisor.docker import labels
from supervisor.docker.spec import Container, RunSpec, changed_settings
from supervisor.engines.base import Observed, Prerequisite
from supervisor.protocol.documents import (
    DesiredFile,
    DesiredState,
    RunningEngine,
    State,
    Status,
    TargetGroup,
)

UNREQUESTED: Final = "no valid request in desired.json; the engine is left as it is"
REFUSED: Final = "request refused: "
# seconds before a failed step that may pass by waiting is tried again, growing to the last
BACKOFF: Final = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Memory:
    """What the worker knows about the generation it is applying. Forgotten on restart."""

    generation: int
    desired: DesiredState
    ready: str | None = None  # id of the container seen answering its ready path
    failure: str | None = None  # why its last step failed; shown instead of any step until retried
    checked: str | None = None  # the fingerprint of the run spec whose preflight passed
    retry_at: float | None = None  # when a step may be planned again despite the failure (the
    # loop's monotonic clock); None: never by waiting, only by a new request or a recipe reload
    failures: int = 0  # failures in a row, for the back-off; forgotten once the request is met
    # the container the last status.json, written before this worker started, said served
    # this generation: its death while no worker looked is a death all the same
    served_before: str | None = None


@dataclass(frozen=True)
class Reported:
    """What the worker's own last status.json said served, as it found it at startup."""

    generation: int
    container_id: str


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


def running_engine(container: Container, version: str | None = None) -> RunningEngine:
    """What runs, as the container's own labels recorded it when it was created, and the
    version the engine reported of itself."""
    found = container.labels
    return RunningEngine(
        image=found.get(labels.IMAGE_REF, ""),
        image_id=container.image_id,
        container_id=container.id,
        recipe_commit=found.get(labels.RECIPE_COMMIT),
        model=found.get(labels.MODEL, ""),
        model_revision=found.get(labels.MODEL_REVISION),
        engine_version=version,
    )


# -- a new desired.json ------------------------------------------------------------------------


def reported(status: Status | None, booted: datetime) -> Reported | None:
    """What a status.json found at startup says served; None when it says nothing serves, or
    was written before this boot (a reboot ended the engine with the machine: re-applied)."""
    if status is None or status.state != "running" or status.engine is None:
        return None
    if status.checked_at < booted:
        return None
    return Reported(status.generation, status.engine.container_id)


def accept(
    memory: Memory | None, desired: DesiredFile, before: Reported | None = None
) -> Memory | None:
    """The memory for a request read from desired.json; None when it asks nothing new.

    Asking again for what already serves keeps the container seen answering (no new readiness
    probe; its file_sd target stays, also after a refused replacement, since a death forgets
    that container); a failure is never carried over, so a new request retries. A worker's
    first request remembers what the last status said served for that same generation (before)."""
    if memory is not None and (memory.generation, memory.desired) == (
        desired.generation,
        desired.desired,
    ):
        return None
    ready = None
    if memory is not None and memory.desired == desired.desired:
        ready = memory.ready
    served = None
    if memory is None and before is not None and desired.desired == "running":
        served = before.container_id if before.generation == desired.generation else None
    return Memory(desired.generation, desired.desired, ready=ready, served_before=served)


def reloaded(memory: Memory) -> Memory:
    """The current request applied anew to a reloaded recipe: what failed and what was checked
    are forgotten (the recipe may fix or change them), so everything is tried at once; the
    container seen answering still serves until a replacement stops it."""
    return Memory(
        memory.generation, memory.desired, ready=memory.ready, served_before=memory.served_before
    )


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


def plan(memory: Memory | None, observed: Observed, now: float) -> Decision:
    """The decision for this observation; now (the loop's monotonic clock) says whether a
    remembered failure's retry time has come."""
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
        decision = _plan_stopped(memory, container)
    else:
        decision = _plan_running(memory, observed, container)
    step = decision.step
    if step is None or memory.failure is None or due(memory, now):
        return decision
    return _still_failed(memory, observed, container, step, now)


def due(memory: Memory, now: float) -> bool:
    """Whether a failed generation may try a step again: only once its retry time has come."""
    return memory.retry_at is not None and now >= memory.retry_at


def _plan_stopped(memory: Memory, container: Container | None) -> Decision:
    if container is None:
        return Decision(met(memory), Answer(memory.generation, "stopped", "stopped"))
    if container.running:
        return _working(memory, Stop(container.id, "stop requested"))
    return _working(memory, Remove(container.id))


def _plan_running(memory: Memory, observed: Observed, container: Container | None) -> Decision:
    if container is not None and not container.running:
        if container.id in (memory.ready, memory.served_before):  # nothing is left answering
            tail = f": {observed.tail}" if observed.tail else ""
            gone = replace(memory, ready=None, served_before=None)
            return failed(gone, exit_message(container) + tail)
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
        return _working(memory, Stop(container.id, f"replacing: {reason}"))
    if not serving:
        return _working(memory, AwaitReady(container.id))
    message = f"serving at {observed.url}" + (f"; {observed.notes}" if observed.notes else "")
    return _serving(met(memory), observed, container, message)


def _replacing(container: Container, spec: RunSpec) -> str | None:
    """Why this container is not what the spec says, or None when it is."""
    if container.image_id != spec.image:
        return "it runs on another image"
    changed = changed_settings(container.labels.get(labels.FINGERPRINT, ""), spec.fingerprint())
    return f"its {', '.join(changed)} changed" if changed else None


def _still_failed(
    memory: Memory, observed: Observed, container: Container | None, step: Step, now: float
) -> Decision:
    """A remembered failure, shown where its step would be planned again before its retry
    time: an engine that still serves is `running`, saying what was not done and why (its
    file_sd target stays); anything else is `failed`."""
    assert memory.failure is not None
    reason = memory.failure
    if memory.retry_at is not None:
        wait = max(math.ceil(memory.retry_at - now), 1)
        reason = f"{reason.rstrip('.')}; trying again in {wait} s"
    if (
        memory.desired == "running"
        and container is not None
        and container.running
        and container.id == memory.ready
    ):
        why = _replacing(container, step.spec) if isinstance(step, Check) else None
        what = f"the replacement ({why}) was refused" if why else f"{describe(step)} failed"
        return _serving(memory, observed, container, f"serving at {observed.url}; {what}: {reason}")
    return Decision(memory, Answer(memory.generation, "failed", reason))


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
    engine = running_engine(container, observed.version)
    answer = Answer(memory.generation, "running", message, observed.url, engine)
    return Decision(memory, answer, observed.targets, step)


def failed(memory: Memory, reason: str, now: float | None = None) -> Decision:
    """The generation is failed: nothing is started or stopped for it until a new request, or,
    given now (a look that failed: looking again is harmless), until the back-off has passed."""
    retry_at = None if now is None else now + BACKOFF[min(memory.failures, len(BACKOFF) - 1)]
    remembered = replace(memory, failure=reason, retry_at=retry_at, failures=memory.failures + 1)
    return Decision(remembered, Answer(memory.generation, "failed", reason))


def met(memory: Memory) -> Memory:
    """The request is met: whatever failed on the way is forgotten, and so is its back-off."""
    if memory.failure is None and memory.failures == 0:
        return memory
    return replace(memory, failure=None, retry_at=None, failures=0)


def unobserved(
    memory: Memory | None,
    reason: str,
    previous: Decision | None = None,
    answering: bool | None = None,
) -> Decision:
    """Docker could not be asked (down, or no answer in time): no step. An engine the last
    decision had serving serves on while its ready path answers (answering; None: not asked,
    nothing is known to have changed), saying that docker does not answer; otherwise nothing
    is claimed to serve."""
    if memory is None:
        return Decision(None, Answer(0, "failed", f"cannot observe the engine: {reason}"))
    if previous is not None and answering is not False and serving(memory, previous):
        return _unanswered(previous, f"docker does not answer: {reason}")
    state: State = "starting" if memory.desired == "running" else "stopping"
    return Decision(memory, Answer(memory.generation, state, reason))


def stalled(previous: Decision, reason: str) -> Decision:
    """Docker did not answer in time: nothing is known to have changed, so the last answer
    stands, saying why it is not fresh."""
    if previous.memory is not None and serving(previous.memory, previous):
        return _unanswered(previous, reason)
    return replace(previous, answer=replace(previous.answer, message=reason), step=None)


def serving(memory: Memory, previous: Decision) -> bool:
    """Whether the last decision had this generation's engine serving: running, on the
    container seen answering its ready path."""
    answer = previous.answer
    return (
        memory.ready is not None
        and answer.state == "running"
        and answer.generation == memory.generation
        and answer.engine is not None
        and answer.engine.container_id == memory.ready
    )


def _unanswered(previous: Decision, reason: str) -> Decision:
    """The serving answer (its url, engine and targets) with why it is not fresh."""
    message = f"serving at {previous.answer.url}; {reason}"
    return replace(previous, answer=replace(previous.answer, message=message), step=None)


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


def conclude(
    memory: Memory, step: Step, error: str | None, now: float, waitable: bool = False
) -> Memory:
    """What this generation has now done: a container seen answering, a passed check, or a
    failure. A failure that may pass by waiting (waitable: a port, memory or an image held or
    missing for now) is tried again after a growing back-off, and so is a failed Stop or
    Remove (its effect is always wanted, and the operator may fix Docker meanwhile); any other
    failure waits for a new request or a recipe reload."""
    if error is not None:
        retry_at = None
        if waitable or isinstance(step, Stop | Remove):
            retry_at = now + BACKOFF[min(memory.failures, len(BACKOFF) - 1)]
        return replace(memory, failure=error, retry_at=retry_at, failures=memory.failures + 1)
    done = replace(memory, failure=None, retry_at=None)  # the failures in a row stay counted
    if isinstance(step, AwaitReady):
        return replace(done, ready=step.container_id)
    if isinstance(step, Check):
        return replace(done, checked=step.spec.fingerprint())
    return done
