"""The loop's one wake-up: a self-pipe. Threads, the watcher and signals write a byte; the loop
waits on it with a timeout. Writing takes no lock, so a signal handler (or the C-level wakeup
fd of the signal module) can use it while the loop holds any lock of its own."""

from __future__ import annotations

import contextlib
import os
import select
import signal


class Wakeup:
    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous_fd: int | None = None

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # full: a wake-up is pending anyway
            os.write(self._write, b"\0")

    def wait(self, timeout: float) -> bool:
        """Wait until woken or the timeout passes; True when woken. Drains pending wake-ups."""
        ready, _, _ = select.select([self._read], [], [], max(timeout, 0.0))
        if not ready:
            return False
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read, 4096):
                pass
        return True

    def catch_signals(self) -> None:
        """Make the signal module write to this pipe when a signal arrives (main thread only)."""
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def close(self) -> None:
        if self._previous_fd is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self._previous_fd = None
        os.close(self._read)
        os.close(self._write)
