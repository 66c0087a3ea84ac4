"""A tier's health: a fault switches it off, a back-off retries it; frozen state, pure decisions.

A tier is an optimisation: whatever its disk does (an I/O error, a remount read-only, its
directory removed), the engine serves on with the other tiers and recomputes what that one
held. The store switches a failing tier off for this engine, says so once, and tries it again
after a back-off that doubles up to MAX_BACKOFF; a tier that opens again is rebuilt from its
directory and on again. A full disk is not a fault: the tier fits itself to what the disk holds
(lucia_kv.tier). Warnings about the same thing are said at most once per WARN_EVERY seconds.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, replace
from typing import Final

FIRST_BACKOFF: Final = 5.0  # seconds before the first retry of a tier that failed
MAX_BACKOFF: Final = 300.0
WARN_EVERY: Final = 60.0  # seconds between two warnings of one kind about one tier
UNSAFE: Final = "unsafe"  # the reason of a directory refused for its owner, mode or type
OTHER: Final = "error"  # an error without an errno


def reason(error: BaseException) -> str:
    """A fault's reason as a short label: the errno's name in lower case (erofs, eio, enoent),
    UNSAFE for a directory refused as unsafe, OTHER for anything else."""
    number = getattr(error, "errno", None)
    if isinstance(number, int) and number in errno.errorcode:
        return errno.errorcode[number].lower()
    return OTHER


def words(label: str) -> str:
    """A reason label as an operator reads it: the errno's own text ("read-only file
    system"), or the label itself."""
    number = getattr(errno, label.upper(), None) if label.startswith("e") else None
    if isinstance(number, int):
        return os.strerror(number).lower()
    return "its directory is not owner-only or not a directory" if label == UNSAFE else label


@dataclass(frozen=True)
class Health:
    """On (off is None), or off for a reason since a time, next tried at retry_at."""

    off: str | None = None
    since: float = 0.0
    retry_at: float = 0.0
    backoff: float = 0.0

    @property
    def on(self) -> bool:
        return self.off is None

    def due(self, now: float) -> bool:
        """Whether an off tier is to be tried again now."""
        return self.off is not None and now >= self.retry_at


def failed(health: Health, label: str, now: float, first: float = FIRST_BACKOFF) -> Health:
    """After a fault: off, tried again after the first back-off; an off tier whose retry
    failed waits twice as long as before, up to MAX_BACKOFF."""
    if health.off is None:
        return Health(label, now, now + first, first)
    backoff = min(max(health.backoff * 2, first), MAX_BACKOFF)
    return replace(health, off=label, retry_at=now + backoff, backoff=backoff)


def recovered() -> Health:
    return Health()


@dataclass(frozen=True)
class Said:
    """When a warning of one kind was last said, and how many were held back since."""

    at: float = float("-inf")
    held: int = 0


def warn(said: Said, now: float, every: float = WARN_EVERY) -> tuple[Said, int | None]:
    """Whether to say a warning now: (the new state, how many were held back before it) when
    it is said, (the new state, None) when it is held back."""
    if now - said.at >= every:
        return Said(now, 0), said.held
    return replace(said, held=said.held + 1), None
