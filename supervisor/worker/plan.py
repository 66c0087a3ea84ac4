"""Pure: (the request, what was observed, what this generation already did) -> one Decision.

The decision is whole: the next step, what status.json says and what the file_sd file holds. The
worker observes off its loop, calls plan(), writes what the decision says and runs its step; it
decides nothing itself. No I/O here, and no Docker: the container is the project's own value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Final, Literal

from supervisor.docker import labels
from supervisor.docker.spec import Container, RunSpec, changed_settings
from supervisor.engines.base import Observed
from supervisor.protocol.documents import RunningEngine, State, TargetGroup
from supervisor.worker.exits import exit_message
from supervisor.worker.pursuit import BACKOFF, Pursuit, due, met
from supervisor.worker.steps import AwaitReady, Check, Prepare, Remove, Start, Step, Stop, describe

UNREQUESTED: Final = "no valid request in desired.json; the engine is left as it is"
REFUSED: Final = "request refused: "
RECIPE_REFUSED: Final = "recipe reload refused (the recipe loaded before stays in use): "


@dataclass(frozen=True)
class Answer:
    """What status.json says (the worker adds the times, the refusal and the heartbeat)."""

    generation: int
    state: State
    message: str
    url: str | None = None
    engine: RunningEngine | None = None
    retrying: bool = False  # failed, and its step is tried again after a back-off
    waiting_for: Literal["memory"] | None = None  # retrying: what the step waits for


@dataclass(frozen=True)
class Decision:
    pursuit: Pursuit | None
    answer: Answer
    targets: tuple[TargetGroup, ...] = ()
    step: Step | None = None


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


def acknowledge(pursuit: Pursuit, previous: Decision | None) -> Decision:
    """Answer a new generation at once, before any work: starting or stopping. A re-request
    of a serving engine keeps its Prometheus target: the engine goes on serving."""
    state: State = "starting" if pursuit.desired == "running" else "stopping"
    targets = previous.targets if previous is not None and pursuit.ready is not None else ()
    return Decision(
        pursuit,
        Answer(pursuit.generation, state, f"acknowledged: {pursuit.desired} requested"),
        targets,
    )


def shown(answer: Answer, refused: str | None, recipe_refused: str | None = None) -> Answer:
    """A refused desired.json is named in a settled answer, and a refused recipe reload ahead of
    what it says (the engine is left on the recipe it has); a working one keeps its progress."""
    if answer.state not in ("running", "stopped", "failed"):
        return answer
    message = REFUSED + refused if refused else answer.message
    if recipe_refused:
        message = f"{RECIPE_REFUSED}{recipe_refused}; {message}"
    return replace(answer, message=message)


# -- what to do next ---------------------------------------------------------------------------


def plan(pursuit: Pursuit | None, observed: Observed, now: float) -> Decision:
    """The decision for this observation; now (the loop's monotonic clock) says whether a
    remembered failure's retry time has come."""
    container = observed.container
    if pursuit is None:
        state: State = "running" if container is not None and container.running else "stopped"
        return Decision(None, Answer(0, state, UNREQUESTED))
    if container is not None and not container.managed:
        return failed(
            pursuit,
            f"a container named {container.name} exists that lucia-supervisor did not create; "
            "remove or rename it, then request again",
        )
    if pursuit.desired == "stopped":
        decision = _plan_stopped(pursuit, container)
    else:
        decision = _plan_running(pursuit, observed, container)
    step = decision.step
    if step is None or pursuit.failure is None or due(pursuit, now):
        return decision
    return _still_failed(pursuit, observed, container, step, now)


def _plan_stopped(pursuit: Pursuit, container: Container | None) -> Decision:
    if container is None:
        return Decision(met(pursuit), Answer(pursuit.generation, "stopped", "stopped"))
    if container.running:
        return _working(pursuit, Stop(container.id, "stop requested"))
    return _working(pursuit, Remove(container.id))


def _plan_running(pursuit: Pursuit, observed: Observed, container: Container | None) -> Decision:
    if container is not None and not container.running:
        if container.id in (pursuit.ready, pursuit.served_before):  # nothing is left answering
            gone = replace(pursuit, ready=None, served_before=None)
            return failed(gone, exit_message(container, observed.log))
        return _working(pursuit, Remove(container.id))  # left from before: clear the name
    serving = container is not None and container.id == pursuit.ready
    if observed.missing:
        step = Prepare(observed.missing[0])
        if container is not None:  # a library re-sync or a build: a serving engine serves on
            return _serving_or_working(pursuit, observed, container, step)
        return _working(pursuit, step)
    spec = observed.spec
    if spec is None:
        return failed(pursuit, "the engine image is missing after it was built")
    checked = pursuit.checked == spec.fingerprint()
    if container is None:
        return _working(pursuit, Start(spec) if checked else Check(spec))
    reason = _replacing(container, spec)
    if reason is not None:
        if not checked:  # a replacement that cannot start never stops the running engine
            return _serving_or_working(pursuit, observed, container, Check(spec, container.id))
        return _working(pursuit, Stop(container.id, f"replacing: {reason}"))
    if not serving:
        return _working(pursuit, AwaitReady(container.id))
    message = f"serving at {observed.url}" + (f"; {observed.notes}" if observed.notes else "")
    return _serving(met(pursuit), observed, container, message)


def _replacing(container: Container, spec: RunSpec) -> str | None:
    """Why this container is not what the spec says, or None when it is."""
    if container.image_id != spec.image:
        return "it runs on another image"
    changed = changed_settings(container.labels.get(labels.FINGERPRINT, ""), spec.fingerprint())
    return f"its {', '.join(changed)} changed" if changed else None


def _still_failed(
    pursuit: Pursuit, observed: Observed, container: Container | None, step: Step, now: float
) -> Decision:
    """A remembered failure, shown where its step would be planned again before its retry
    time: an engine that still serves is `running`, saying what was not done and why (its
    file_sd target stays); anything else is `failed`."""
    assert pursuit.failure is not None
    reason = pursuit.failure
    if pursuit.retry_at is not None:
        wait = max(math.ceil(pursuit.retry_at - now), 1)
        reason = f"{reason.rstrip('.')}; trying again in {wait} s"
    if (
        pursuit.desired == "running"
        and container is not None
        and container.running
        and container.id == pursuit.ready
    ):
        why = _replacing(container, step.spec) if isinstance(step, Check) else None
        what = f"the replacement ({why}) was refused" if why else f"{describe(step)} failed"
        message = f"serving at {observed.url}; {what}: {reason}"
        return _serving(pursuit, observed, container, message)
    retrying = pursuit.retry_at is not None
    waiting_for: Literal["memory"] | None = None
    if retrying and pursuit.memory_blocked:
        waiting_for = "memory"
    answer = Answer(
        pursuit.generation, "failed", reason, retrying=retrying, waiting_for=waiting_for
    )
    return Decision(pursuit, answer)


def _serving_or_working(
    pursuit: Pursuit, observed: Observed, container: Container, step: Step
) -> Decision:
    if container.id == pursuit.ready:
        return _serving(pursuit, observed, container, describe(step), step)
    return _working(pursuit, step)


def _working(pursuit: Pursuit, step: Step) -> Decision:
    state: State = "starting" if pursuit.desired == "running" else "stopping"
    return Decision(pursuit, Answer(pursuit.generation, state, describe(step)), step=step)


def _serving(
    pursuit: Pursuit,
    observed: Observed,
    container: Container,
    message: str,
    step: Step | None = None,
) -> Decision:
    engine = running_engine(container, observed.version)
    answer = Answer(pursuit.generation, "running", message, observed.url, engine)
    return Decision(pursuit, answer, observed.targets, step)


def failed(pursuit: Pursuit, reason: str, now: float | None = None) -> Decision:
    """The generation is failed: nothing is started or stopped for it until a new request, or,
    given now (a look that failed: looking again is harmless), until the back-off has passed."""
    retry_at = None if now is None else now + BACKOFF[min(pursuit.failures, len(BACKOFF) - 1)]
    remembered = replace(pursuit, failure=reason, retry_at=retry_at, failures=pursuit.failures + 1)
    answer = Answer(pursuit.generation, "failed", reason, retrying=retry_at is not None)
    return Decision(remembered, answer)


def unobserved(
    pursuit: Pursuit | None,
    reason: str,
    previous: Decision | None = None,
    answering: bool | None = None,
) -> Decision:
    """Docker could not be asked (down, or no answer in time): no step. An engine the last
    decision had serving serves on while its ready path answers (answering; None: not asked,
    nothing is known to have changed), saying that docker does not answer; otherwise nothing
    is claimed to serve."""
    if pursuit is None:
        return Decision(None, Answer(0, "failed", f"cannot observe the engine: {reason}"))
    if previous is not None and answering is not False and serving(pursuit, previous):
        return _unanswered(previous, f"docker does not answer: {reason}")
    state: State = "starting" if pursuit.desired == "running" else "stopping"
    return Decision(pursuit, Answer(pursuit.generation, state, reason))


def stalled(previous: Decision, reason: str) -> Decision:
    """Docker did not answer in time: nothing is known to have changed, so the last answer
    stands, saying why it is not fresh."""
    if previous.pursuit is not None and serving(previous.pursuit, previous):
        return _unanswered(previous, reason)
    return replace(previous, answer=replace(previous.answer, message=reason), step=None)


def serving(pursuit: Pursuit, previous: Decision) -> bool:
    """Whether the last decision had this generation's engine serving: running, on the
    container seen answering its ready path."""
    answer = previous.answer
    return (
        pursuit.ready is not None
        and answer.state == "running"
        and answer.generation == pursuit.generation
        and answer.engine is not None
        and answer.engine.container_id == pursuit.ready
    )


def _unanswered(previous: Decision, reason: str) -> Decision:
    """The serving answer (its url, engine and targets) with why it is not fresh."""
    message = f"serving at {previous.answer.url}; {reason}"
    return replace(previous, answer=replace(previous.answer, message=message), step=None)
