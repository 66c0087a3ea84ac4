"""status.json: the worker's truthful, regularly refreshed answer."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Final

from . import files, logs, redaction
from .notify import Notifier
from .protocol import State, Status, clean_message, dump, utc_now
from .telemetry import Metrics

_MESSAGE_EVERY: Final = 1.0  # progress lines are coalesced to one write a second
log = logs.get("heartbeat")


class Heartbeat:
    """Writes status.json at once when the answer changes, and at least every interval."""

    def __init__(
        self,
        path: Path,
        interval: float,
        notifier: Notifier,
        metrics: Metrics,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.path = path
        self.interval = interval
        self._notifier = notifier
        self._metrics = metrics
        self._clock = clock
        self.status: Status | None = None
        self._written_at = float("-inf")
        self._dirty = False

    def set(
        self,
        generation: int,
        state: State,
        message: str,
        url: str | None = None,
        refused: str | None = None,
    ) -> None:
        now = self._clock()
        line = clean_message(redaction.redact(message))
        previous = self.status
        if previous is None or (previous.generation, previous.state) != (generation, state):
            since = now
        else:
            since = previous.since
        status = Status(
            generation=generation,
            state=state,
            since=since,
            message=line,
            url=url if state == "running" else None,
            checked_at=now,
            refused=clean_message(redaction.redact(refused)) if refused else None,
        )
        self.status = status
        if previous is not None and _same_answer(previous, status):
            if previous.message != status.message:
                self._dirty = True
                self.tick()
            return
        self._notifier.status(f"{state}: {line}")
        self._metrics.set_state(state)
        self._write()

    def tick(self) -> None:
        """Write if a coalesced change waits or the heartbeat is due."""
        elapsed = time.monotonic() - self._written_at
        if (self._dirty and elapsed >= _MESSAGE_EVERY) or elapsed >= self.interval:
            self._write()

    def due_in(self) -> float:
        elapsed = time.monotonic() - self._written_at
        wait = self.interval - elapsed
        if self._dirty:
            wait = min(wait, _MESSAGE_EVERY - elapsed)
        return max(wait, 0.0)

    def _write(self) -> None:
        if self.status is None:
            return
        status = self.status.model_copy(update={"checked_at": self._clock()})
        try:
            files.write_atomic(self.path, dump(status))
        except OSError as exc:
            # e.g. a full disk: the previous status stays intact; retried on the next tick
            self._dirty = True
            self._written_at = time.monotonic() - self.interval + _MESSAGE_EVERY
            log.error("status write failed", path=str(self.path), error=str(exc))
            return
        self.status = status
        self._written_at = time.monotonic()
        self._dirty = False
        self._notifier.status(f"{status.state}: {status.message}")
        self._metrics.heartbeat.set(status.checked_at.timestamp())


def _same_answer(a: Status, b: Status) -> bool:
    return (a.generation, a.state, a.url, a.refused) == (b.generation, b.state, b.url, b.refused)
