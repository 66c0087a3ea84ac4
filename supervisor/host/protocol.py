"""The host's side of the protocol: write requests, read answers. It never touches Docker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Final, Literal

from supervisor.protocol.documents import (
    SCHEMA_VERSION,
    DesiredFile,
    DesiredState,
    Requester,
    Status,
    dump,
    utc_now,
)
from supervisor.protocol.files import FileLock, ensure_dir, read_text, write_atomic
from supervisor.protocol.layout import DESIRED, engine_dir
from supervisor.protocol.reads import load_status, read_desired

STALE_AFTER: Final = timedelta(seconds=60)
_REQUEST_LOCK: Final = ".request.lock"
_ISSUED: Final = ".generation"  # the last generation the host issued, never reused

Answer = Literal["current", "pending", "unavailable"]


@dataclass(frozen=True)
class Reading:
    """What the host knows about one engine: the answer kind, the status, and why."""

    answer: Answer
    status: Status | None
    reason: str


class Superseded(Exception):
    """desired.json no longer says what a conditional request was made on: someone asked since.
    Nothing was written; `current` is the request on file now."""

    def __init__(self, name: str, current: DesiredFile | None) -> None:
        said = f"generation {current.generation} ({current.desired})" if current else "nothing"
        super().__init__(f"{name}: desired.json says {said} now")
        self.current = current


def request(
    data_dir: Path,
    name: str,
    desired: DesiredState,
    by: Requester | str = "operator",
    *,
    only_if: Callable[[DesiredFile | None], bool] | None = None,
) -> int:
    """Write the next generation of desired.json, saying who asked (`by`) and when, and return
    it; the first request is 1.

    A lock around read-increment-write means concurrent requesters never issue the same
    generation. The next generation is above the last request, the last applied status and the
    last one issued here, so a lost, hand-edited or restored desired.json (which the worker then
    answers) can neither make a new request look already answered nor reuse a number.

    `only_if` makes the write conditional on the request on file, checked under the same lock:
    when it says no, nothing is written and Superseded is raised. The gateway writes only so,
    on what it read when it decided, so it never overwrites an operator's request made since.
    """
    directory = ensure_dir(engine_dir(data_dir, name))
    with FileLock(directory / _REQUEST_LOCK):
        previous = read_desired(directory)
        if only_if is not None and not only_if(previous):
            raise Superseded(name, previous)
        status = load_status(directory)
        generation = 1 + max(
            previous.generation if previous else 0,
            status.generation if status else 0,
            _issued(directory),
        )
        document = DesiredFile.model_validate(
            {
                "schemaVersion": SCHEMA_VERSION,
                "generation": generation,
                "desired": desired,
                "requestedBy": by,
                "requestedAt": utc_now(),
            }
        )
        write_atomic(directory / _ISSUED, f"{generation}\n".encode(), 0o600)
        write_atomic(directory / DESIRED, dump(document))
    return generation


def _issued(directory: Path) -> int:
    try:
        text = read_text(directory / _ISSUED, limit=64)
    except (OSError, ValueError):
        return 0
    return int(text) if text.strip().isdigit() else 0


def classify(status: Status | None, generation: int, now: datetime) -> Reading:
    """Pure: does this status answer this generation, and is its worker alive?"""
    if status is None:
        return Reading("unavailable", None, "no status yet: is the worker running?")
    age = now - status.checked_at
    if age > STALE_AFTER:
        seconds = f"{age.total_seconds():.0f}"
        return Reading("unavailable", status, f"worker unavailable: last heartbeat {seconds}s ago")
    if status.generation != generation:
        return Reading(
            "pending",
            status,
            f"waiting for generation {generation}; the worker answers {status.generation}",
        )
    return Reading("current", status, status.message)


def read_status(data_dir: Path, name: str, generation: int, now: datetime | None = None) -> Reading:
    """Classify the engine's status against a generation; time is a parameter for tests."""
    status = load_status(engine_dir(data_dir, name))
    return classify(status, generation, now if now is not None else utc_now())
