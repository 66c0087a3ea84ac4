"""The soak's liveness rule, pure: a request for `running` that no fault touched reaches
`running` within a bound, and a `failed` has a cause in the schedule.

A request is one generation of desired.json, as the checker saw it; the faults are the runner's
events (kind, engine or "*", start, end). A fault touches a request when its window (from a
little before it starts, for samples taken one by one, until the worker is back after it ends)
overlaps the time the request was under way. What a fault may do depends on its kind: some only
delay an answer, some may also make a request fail; host requests are not faults (a newer
generation supersedes an older one instead).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

BOUND: Final = 60.0  # an untouched request for running reaches running within this
TOLERANCE: Final = 3.0  # files and Docker are sampled one by one
RETURN: Final = 15.0  # systemd's restart and the worker's first status after a fault
# a fault that may make a request fail: its engine died, or Docker could not be asked, or the
# data directory could not be written
FAILS: Final = frozenset(
    {"engine-kill", "engine-oom", "dockerd-restart", "dockerd-stall", "disk-full"}
)
# a fault that may only make an answer late: the worker was away, re-read its recipe, replaced
# its engine, or saw no valid request for a while
DELAYS: Final = FAILS | {
    "worker-kill",
    "worker-stop",
    "worker-reload",
    "recipe-edit",
    "bad-desired",
}
STATES: Final = ("starting", "running", "stopping", "stopped", "failed")


@dataclass(frozen=True)
class Request:
    """One generation of one engine's desired.json, and what its status reached, when."""

    engine: str
    generation: int
    desired: str
    seen: float  # when desired.json first showed it
    superseded: float | None = None  # when a newer generation was first seen
    reached: Mapping[str, float] = field(default_factory=dict)  # state -> first seen

    @property
    def deadline(self) -> float:
        return self.seen + BOUND


def touches(
    event: Mapping[str, Any], engine: str, start: float, end: float, kinds: frozenset[str]
) -> bool:
    """Whether a fault of one of `kinds` was under way for `engine` during [start, end]. A
    fault still under way (no end yet) lasts until now, which is past any window asked about."""
    if event["kind"] not in kinds or event["engine"] not in (engine, "*"):
        return False
    fault_end = event.get("end")
    if fault_end is not None and fault_end + RETURN < start:
        return False
    return bool(event["start"] - TOLERANCE <= end)


def late(request: Request, events: Iterable[Mapping[str, Any]], now: float) -> str | None:
    """Why a request for running breaks liveness at `now`, or None: it is past its deadline,
    has not reached running, was not superseded before the deadline, and no fault touched it."""
    if request.desired != "running" or "running" in request.reached or now < request.deadline:
        return None
    if request.superseded is not None and request.superseded <= request.deadline:
        return None
    if any(touches(e, request.engine, request.seen, request.deadline, DELAYS) for e in events):
        return None
    states = ", ".join(sorted(request.reached, key=request.reached.__getitem__)) or "nothing"
    return (
        f"generation {request.generation} (running) untouched by any fault, not running "
        f"{BOUND:g} s after it was written (reached: {states})"
    )


def unexplained_failure(request: Request, events: Iterable[Mapping[str, Any]]) -> str | None:
    """Why a request's `failed` has no cause, or None: it never failed, or a fault that may fail
    a request touched it between its writing and the failure."""
    failed = request.reached.get("failed")
    if failed is None:
        return None
    if any(touches(e, request.engine, request.seen, failed, FAILS) for e in events):
        return None
    return (
        f"generation {request.generation} ({request.desired}) failed "
        f"{failed - request.seen:.1f} s after it was written, and no fault in the schedule "
        "touched it"
    )


def reached_counts(requests: Iterable[Request]) -> dict[str, int]:
    """How many requests reached each state (a request counts once in each state it reached),
    and how many reached no answer at all (`unanswered`: superseded first, or never answered)."""
    counts: Counter[str] = Counter({state: 0 for state in (*STATES, "unanswered", "requests")})
    for request in requests:
        counts["requests"] += 1
        counts.update(request.reached.keys())
        if not set(request.reached) & {"running", "stopped", "failed"}:
            counts["unanswered"] += 1
    return dict(counts)
