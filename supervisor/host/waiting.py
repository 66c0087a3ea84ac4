"""`request --wait` and `wait`: follow one engine's status until it answers, showing progress.

On a terminal the progress is one line, redrawn in place with the elapsed time; off a terminal
(a pipe, a log) a line is written when the message changes, at most one every few seconds.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, TextIO

from watchfiles import watch

from supervisor.console import EXIT_FAILED, EXIT_OK, EXIT_UNANSWERED
from supervisor.host import protocol as host
from supervisor.protocol.documents import State
from supervisor.protocol.layout import engine_dir

LINE_EVERY: Final = 5.0  # off a terminal: seconds between progress lines
_CLEAR: Final = "\r\x1b[K"  # carriage return, then erase to the end of the line


def elapsed(seconds: float) -> str:
    """12s, 4m05s, 1h02m05s."""
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


@dataclass
class Progress:
    """Pure: what to write for the latest message at a moment (monotonic seconds)."""

    name: str
    terminal: bool
    started: float
    width: int = 80
    every: float = LINE_EVERY
    _drawn: str = field(default="", init=False)  # the line on screen (terminal)
    _said: str | None = field(default=None, init=False)  # the last message written (pipe)
    _said_at: float = field(default=float("-inf"), init=False)

    def update(self, now: float, message: str) -> str:
        line = f"{self.name}: [{elapsed(now - self.started)}] {message}"
        if self.terminal:
            line = line[: max(self.width - 1, 1)]  # a wrapped line could not be redrawn
            if line == self._drawn:
                return ""
            self._drawn = line
            return _CLEAR + line
        if message == self._said or now - self._said_at < self.every:
            return ""
        self._said, self._said_at = message, now
        return line + "\n"

    def finish(self) -> str:
        """Erase the progress line, so that the outcome takes its place."""
        drawn, self._drawn = self._drawn, ""
        return _CLEAR if self.terminal and drawn else ""


def _changes(directory: Path, stop: threading.Event) -> Iterator[None]:
    """Yield on every change in directory, and at least twice a second."""
    yield None
    for _ in watch(
        directory, stop_event=stop, rust_timeout=500, yield_on_timeout=True, debounce=20, step=10
    ):
        yield None


def _width(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, ValueError):
        return 80


@dataclass(frozen=True)
class WaitOutcome:
    code: int
    out: str = ""  # for stdout
    err: str = ""  # for stderr


def decide(name: str, reading: host.Reading, want: State, hint: str) -> WaitOutcome | None:
    """Pure: the end of the wait this reading makes, if any (time-outs are the caller's)."""
    status = reading.status
    if status is None:
        return None
    if reading.answer == "unavailable":
        return WaitOutcome(EXIT_UNANSWERED, err=f"{name}: {reading.reason} (is it running? {hint})")
    if reading.answer != "current":
        return None
    if status.state == want:
        return WaitOutcome(EXIT_OK, f"{name}: {want}" + (f" at {status.url}" if status.url else ""))
    if status.state == "failed" and not status.retrying:  # a retried failure may yet pass
        return WaitOutcome(EXIT_FAILED, err=f"{name} failed: {status.message}")
    return None


def await_state(
    data_dir: Path,
    name: str,
    generation: int,
    want: State,
    timeout: float,
    *,
    keep_waiting: str,
    no_status_after: float = host.STALE_AFTER.total_seconds(),
) -> int:
    """Wait until the status answers generation with want (0) or failed for good (1; a failure
    the worker retries by itself is shown and waited through); else 3: the worker is stale,
    none has written a status within no_status_after seconds, or the timeout passed.
    keep_waiting is the command that waits on (said on a timeout)."""
    directory = engine_dir(data_dir, name)
    started = time.monotonic()
    stream = sys.stderr
    terminal = stream.isatty()
    progress = Progress(name, terminal, started, _width(stream) if terminal else 80)
    hint = f"systemctl --user start lucia-{name}"
    stop = threading.Event()
    outcome = WaitOutcome(EXIT_UNANSWERED)
    try:
        for _ in _changes(directory, stop):
            now = time.monotonic()
            reading = host.read_status(data_dir, name, generation)
            status = reading.status
            found = decide(name, reading, want, hint)
            if found is None and status is None and now - started >= no_status_after:
                found = WaitOutcome(
                    EXIT_UNANSWERED,
                    err=f"{name}: no worker has written a status in {elapsed(now - started)}; "
                    f"start it with: {hint} (the request stays; then: {keep_waiting})",
                )
            if found is None and now - started >= timeout:
                found = WaitOutcome(
                    EXIT_UNANSWERED,
                    err=f"{name}: timed out after {elapsed(timeout)} ({reading.reason}); "
                    f"the request goes on: keep waiting with: {keep_waiting}",
                )
            if found is not None:
                outcome = found
                break
            message = reading.reason if status is not None else f"{reading.reason} ({hint})"
            stream.write(progress.update(now, message))
            stream.flush()
    finally:
        stop.set()
        stream.write(progress.finish())
        stream.flush()
    if outcome.out:
        print(outcome.out, flush=True)
    if outcome.err:
        print(f"lucia-supervisor: {outcome.err}", file=sys.stderr, flush=True)
    return outcome.code
