"""The generation the worker pursues, what it knows of it, and how each event changes that.

Pure, like the plan that reads it: a new desired.json (accept), a recipe reload (reloaded), a
step that ended (conclude), a request met (met). Forgotten on restart, but for what the last
status.json said served (reported).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Final

from supervisor.protocol.documents import DesiredFile, DesiredState, Status
from supervisor.worker.steps import AwaitReady, Check, Remove, Step, Stop

# seconds before a failed step that may pass by waiting is tried again, growing to the last
BACKOFF: Final = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class Pursuit:
    """The generation the worker is applying and what it knows about it. Forgotten on restart."""

    generation: int
    desired: DesiredState
    ready: str | None = None  # id of the container seen answering its ready path
    failure: str | None = None  # why its last step failed; shown instead of any step until retried
    checked: str | None = None  # the fingerprint of the run spec whose preflight passed
    retry_at: float | None = None  # when a step may be planned again despite the failure (the
    # loop's monotonic clock); None: never by waiting, only by a new request or a recipe reload
    failures: int = 0  # failures in a row, for the back-off; forgotten once the request is met
    memory_blocked: bool = False  # the failure is memory others hold or use now (MemoryBlocked)
    # the container the last status.json, written before this worker started, said served
    # this generation: its death while no worker looked is a death all the same
    served_before: str | None = None


@dataclass(frozen=True)
class Reported:
    """What the worker's own last status.json said served, as it found it at startup."""

    generation: int
    container_id: str


def reported(status: Status | None, booted: datetime) -> Reported | None:
    """What a status.json found at startup says served; None when it says nothing serves, or
    was written before this boot (a reboot ended the engine with the machine: re-applied)."""
    if status is None or status.state != "running" or status.engine is None:
        return None
    if status.checked_at < booted:
        return None
    return Reported(status.generation, status.engine.container_id)


def accept(
    pursuit: Pursuit | None, desired: DesiredFile, before: Reported | None = None
) -> Pursuit | None:
    """The pursuit for a request read from desired.json; None when it asks nothing new.

    Asking again for what already serves keeps the container seen answering (no new readiness
    probe; its file_sd target stays, also after a refused replacement, since a death forgets
    that container); a failure is never carried over, so a new request retries. A worker's
    first request remembers what the last status said served for that same generation (before)."""
    if pursuit is not None and (pursuit.generation, pursuit.desired) == (
        desired.generation,
        desired.desired,
    ):
        return None
    ready = None
    if pursuit is not None and pursuit.desired == desired.desired:
        ready = pursuit.ready
    served = None
    if pursuit is None and before is not None and desired.desired == "running":
        served = before.container_id if before.generation == desired.generation else None
    return Pursuit(desired.generation, desired.desired, ready=ready, served_before=served)


def reloaded(pursuit: Pursuit) -> Pursuit:
    """The current request applied anew to a reloaded recipe: what failed and what was checked
    are forgotten (the recipe may fix or change them), so everything is tried at once; the
    container seen answering still serves until a replacement stops it."""
    return Pursuit(
        pursuit.generation,
        pursuit.desired,
        ready=pursuit.ready,
        served_before=pursuit.served_before,
    )


def due(pursuit: Pursuit, now: float) -> bool:
    """Whether a failed generation may try a step again: only once its retry time has come."""
    return pursuit.retry_at is not None and now >= pursuit.retry_at


def retry_in(pursuit: Pursuit | None, now: float) -> float | None:
    """How long until a failed step may be tried again (0: now); None: not by waiting."""
    if pursuit is None or pursuit.failure is None or pursuit.retry_at is None:
        return None
    return max(pursuit.retry_at - now, 0.0)


def met(pursuit: Pursuit) -> Pursuit:
    """The request is met: whatever failed on the way is forgotten, and so is its back-off."""
    if pursuit.failure is None and pursuit.failures == 0:
        return pursuit
    return replace(pursuit, failure=None, retry_at=None, failures=0, memory_blocked=False)


def means_to_start(pursuit: Pursuit | None) -> bool:
    """Whether this generation still means to start the spec its Check passed, so that what
    the Check claimed (its memory) is still wanted: a stop, a failure or a newer request ends
    that, and a newer request's own Check claims again."""
    return (
        pursuit is not None
        and pursuit.desired == "running"
        and pursuit.failure is None
        and pursuit.checked is not None
    )


# -- a step has ended --------------------------------------------------------------------------


def conclude(
    pursuit: Pursuit,
    step: Step,
    error: str | None,
    now: float,
    *,
    waitable: bool = False,
    memory_blocked: bool = False,
) -> Pursuit:
    """What this generation has now done: a container seen answering, a passed check, or a
    failure. A failure that may pass by waiting (waitable: a port, memory or an image held or
    missing for now) is tried again after a growing back-off, and so is a failed Stop or
    Remove (its effect is always wanted, and the operator may fix Docker meanwhile); any other
    failure waits for a new request or a recipe reload."""
    if error is not None:
        retry_at = None
        if waitable or isinstance(step, Stop | Remove):
            retry_at = now + BACKOFF[min(pursuit.failures, len(BACKOFF) - 1)]
        return replace(
            pursuit,
            failure=error,
            retry_at=retry_at,
            failures=pursuit.failures + 1,
            memory_blocked=memory_blocked and retry_at is not None,
        )
    # failures stay counted
    done = replace(pursuit, failure=None, retry_at=None, memory_blocked=False)
    if isinstance(step, AwaitReady):
        return replace(done, ready=step.container_id)
    if isinstance(step, Check):
        return replace(done, checked=step.spec.fingerprint())
    return done
