"""status.json and the file_sd file: the worker's truthful, regularly refreshed answer.

One policy for both: written at once when what they say changes, status.json at least every
interval. A write that fails (a full disk) keeps the last good file, is said in the journal (and
in status.json when that one can still be written) and is retried a second later, not sooner:
a full disk costs one attempt a second, not a busy loop. The worker never exits for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

from supervisor import logs, redaction
from supervisor.engines.base import Observed
from supervisor.notify import Notifier
from supervisor.protocol import files
from supervisor.protocol.documents import (
    Capability,
    MemoryPlan,
    Status,
    TargetGroup,
    clean_message,
    dump,
    parse_status,
    utc_now,
)
from supervisor.protocol.strictjson import InvalidDocument
from supervisor.version import version
from supervisor.worker.plan import Answer
from supervisor.worker.telemetry import FileSdWriter, WorkerMetrics

_MESSAGE_EVERY: Final = 1.0  # progress lines are coalesced to one write a second
_RETRY_EVERY: Final = 1.0  # a failed write is tried again this much later
log = logs.get("heartbeat")


class Heartbeat:
    def __init__(
        self,
        path: Path,
        file_sd: FileSdWriter,
        interval: float,
        notifier: Notifier,
        metrics: WorkerMetrics,
        *,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.path = path
        self.file_sd = file_sd
        self.interval = interval
        self._notifier = notifier
        self._metrics = metrics
        self._clock = clock
        self.status: Status | None = None
        self.models: tuple[str, ...] = ()  # the engine's served names, said in every state
        self.memory_plan: MemoryPlan | None = None  # the last observation's plan of a start
        self.slots: dict[str, int] = {}  # the last observation's, said while running
        # the last observation's, said in every state (none known before the first)
        self.capabilities: dict[str, tuple[Capability, ...]] = {}
        self._written_at = float("-inf")
        self._dirty = False
        self._targets: tuple[TargetGroup, ...] | None = None  # not yet written, when pending
        self._sd_error: str | None = None
        self._retry_at = float("-inf")  # after a failed write: nothing pending is tried before

    def observed(self, result: Observed) -> None:
        """What an observation says that every status carries: its models, their slots and
        capabilities, the plan of a start."""
        self.models = result.models
        self.memory_plan = result.memory_plan
        self.slots = dict(result.slots)
        self.capabilities = dict(result.capabilities)

    def show(
        self, answer: Answer, refused: str | None, targets: Sequence[TargetGroup] = ()
    ) -> None:
        """Say this answer; status.json is rewritten at once when the answer changes (a new
        message alone is coalesced), file_sd when its targets change."""
        self._targets = tuple(targets)
        self._publish_targets()
        now = self._clock()
        line = clean_message(redaction.redact(answer.message))
        previous = self.status
        same_state = previous is not None and (previous.generation, previous.state) == (
            answer.generation,
            answer.state,
        )
        running = answer.state == "running"
        retrying = answer.retrying and answer.state == "failed"
        status = Status(
            generation=answer.generation,
            state=answer.state,
            since=previous.since if previous is not None and same_state else now,
            message=line,
            url=answer.url if running else None,
            checked_at=now,
            refused=clean_message(redaction.redact(refused)) if refused else None,
            engine=answer.engine if running else None,
            retrying=retrying,
            waiting_for=answer.waiting_for if retrying else None,
            models=self.models,
            slots=self.slots if running else {},
            capabilities=self.capabilities,
            memory=_masked(self.memory_plan),
            worker_version=version(),
        )
        self.status = status
        if previous is not None and _same_answer(previous, status):
            if previous.message != status.message:
                self._dirty = True
                self.tick()
            return
        self._metrics.set_state(answer.state)
        self._write()

    def progress(self, message: str) -> None:
        """The same answer with the latest line of a running step (coalesced)."""
        if self.status is None:
            return
        line = clean_message(redaction.redact(message))
        if line != self.status.message:
            self.status = self.status.model_copy(update={"message": line})
            self._dirty = True
            self.tick()

    def tick(self) -> None:
        """Write what waits: a failed file_sd write, a coalesced message, a due heartbeat."""
        now = time.monotonic()
        if now < self._retry_at:
            return
        if self._targets is not None:
            self._publish_targets()
        elapsed = now - self._written_at
        if (self._dirty and elapsed >= _MESSAGE_EVERY) or elapsed >= self.interval:
            self._write()

    def due_in(self) -> float:
        now = time.monotonic()
        elapsed = now - self._written_at
        wait = self.interval - elapsed
        if self._dirty or self._targets is not None:
            wait = min(wait, _MESSAGE_EVERY - elapsed)
        return max(wait, self._retry_at - now, 0.0)

    def _failed(self) -> None:
        self._retry_at = time.monotonic() + _RETRY_EVERY

    def _publish_targets(self) -> None:
        assert self._targets is not None
        try:
            self.file_sd.publish(self._targets)
        except OSError as exc:
            self._failed()
            if self._sd_error is None:
                log.error("file_sd write failed", path=str(self.file_sd.path), error=str(exc))
                self._dirty = True
            self._sd_error = f"Prometheus targets not written: {exc.strerror or exc}"
            return
        if self._sd_error is not None:
            log.info("file_sd written again", path=str(self.file_sd.path))
            self._sd_error = None
            self._dirty = True
        self._targets = None

    def _write(self) -> None:
        if self.status is None:
            return
        status = self.status.model_copy(update={"checked_at": self._clock()})
        shown = status
        if self._sd_error is not None:
            shown = status.model_copy(
                update={"message": clean_message(f"{status.message}; {self._sd_error}")}
            )
        try:
            files.write_atomic(self.path, dump(shown))
        except OSError as exc:  # the previous status stays intact; retried a second from now
            self._dirty = True
            self._failed()
            log.error("status write failed", path=str(self.path), error=str(exc))
            return
        self.status = status
        self._written_at = time.monotonic()
        self._dirty = False
        self._notifier.status(f"{shown.state}: {shown.message}")
        self._metrics.heartbeat.set(status.checked_at.timestamp())


def _same_answer(a: Status, b: Status) -> bool:
    fields = (
        "generation",
        "state",
        "url",
        "refused",
        "engine",
        "retrying",
        "waiting_for",
        "models",
        "slots",
        "capabilities",
    )
    return all(getattr(a, name) == getattr(b, name) for name in fields) and _plan(a) == _plan(b)


def _masked(plan: MemoryPlan | None) -> MemoryPlan | None:
    """The plan with its message masked as the status message is (it may quote a file or an
    error that names a secret value)."""
    if plan is None or not plan.message:
        return plan
    return plan.model_copy(update={"message": clean_message(redaction.redact(plan.message))})


def _plan(status: Status) -> MemoryPlan | None:
    """The memory plan less when it was made: a new verdict is written at once, the same one
    at the next heartbeat."""
    plan = status.memory
    return plan.model_copy(update={"planned_at": None}) if plan is not None else None


def last_written(path: Path) -> Status | None:
    """The status.json a previous worker left; None when there is none or it is unreadable."""
    try:
        return parse_status(files.read_text(path))
    except (OSError, files.FileRefused, InvalidDocument):
        return None


def booted_at() -> datetime:
    """When this machine booted (a status.json from before was written by another boot)."""
    uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    return datetime.now(UTC) - timedelta(seconds=uptime)
