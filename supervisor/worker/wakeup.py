"""What wakes the worker's loop: a self-pipe, the watch of desired.json and the signals.

Threads and signals write a byte to the pipe; the loop waits on it and on the kernel's inotify
queue for desired.json (`watch.py`) with a timeout. Writing takes no lock, so a signal handler
(or the C-level wakeup fd of the signal module) can use it while the loop holds any lock of its
own.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Iterator
from types import FrameType

from supervisor.worker.watch import DesiredWatch


class Signals:
    """The stop and reload signals, as the handlers record them for the loop: a handler only
    appends (atomic), and the pipe the signal module writes to wakes the loop."""

    def __init__(self) -> None:
        self._received: list[int] = []

    def install(self, wake: Wakeup) -> None:
        """Record SIGTERM, SIGINT and SIGHUP, waking the loop through wake (main thread only)."""
        wake.catch_signals()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self._received.append(signum)

    def taken(self) -> Iterator[int]:
        """The signals received since the last call, oldest first, each once."""
        while self._received:
            yield self._received.pop(0)


class Wakeup:
    """The loop's one wait: on the self-pipe and, once attached, on desired.json's watch. Only
    the loop waits; any thread may `set`."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd: int | None = None
        self._watch: DesiredWatch | None = None
        self._full_look = False

    def attach(self, watch: DesiredWatch) -> None:
        """Wake on what changes desired.json as well (the loop's thread only)."""
        self._watch = watch

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending anyway
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> bool:
        """Wait until woken or the timeout passes; True when woken. Drains pending wake-ups.
        Events of other files in the engine directory (the worker's own status writes) are
        read and waited past."""
        deadline = time.monotonic() + max(timeout, 0.0)
        watch = self._watch
        while True:
            if watch is not None and watch.retry():
                self._full_look = True
                return True
            sources: list[int] = [self._read] if watch is None else [self._read, watch.fileno()]
            ready, _, _ = select.select(sources, [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return False
            woken = False
            if self._read in ready:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self._read, 4096):
                        pass
                woken = True
            if watch is not None and watch.fileno() in ready:
                verdict = watch.take()
                self._full_look = self._full_look or verdict.full_look or verdict.lost
                woken = woken or verdict.wakes
            if woken:
                return True

    def full_look_due(self) -> bool:
        """Whether the watch missed something since the last call (its queue overflowed, or it
        was lost): the loop then reads and observes as after a restart."""
        due, self._full_look = self._full_look, False
        return due

    def catch_signals(self) -> None:
        """Make the signal module write to this pipe when a signal arrives (main thread only)."""
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def close(self) -> None:
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        os.close(self._read)
        os.close(self._write)
