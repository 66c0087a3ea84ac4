"""The database call under way, and whether the store said it stalled: one owner, one lock.

The writer's thread begins and ends each database call; the gateway's threads ask whether the
call under way has gone unanswered past stall_s (a frozen server, a lost network: nothing
fails, nothing returns) and say so once. Both sides change the same two facts, so one lock
covers them: a stall is said once per call, and its return is said only after a stall was.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Stalled:
    """What a look at the call under way found: past stall_s, and whether this look is the
    first to find it so (the one to say it)."""

    stalled: bool
    first: bool


class Stall:
    """The call under way: when it began, and whether a look said it stalled."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._lock = threading.Lock()
        self._began: float | None = None  # when the call under way began (monotonic)
        self._said = False  # a look found the call under way stalled

    def begin(self, now: float) -> None:
        """A database call begins."""
        with self._lock:
            self._began, self._said = now, False

    def end(self, failed: bool) -> bool:
        """The call returned or failed: True when it returned after a stall was said (its
        return is worth saying; a failure is said as such)."""
        with self._lock:
            said, self._began, self._said = self._said, None, False
        return said and not failed

    def look(self, now: float) -> Stalled:
        """Whether the call under way has gone unanswered past stall_s."""
        with self._lock:
            if self._began is None or now - self._began <= self.stall_s:
                return Stalled(False, False)
            first, self._said = not self._said, True
        return Stalled(True, first)
