"""One disk tier: a directory of block files under a byte cap, LRU of unpinned blocks, pins.

The index (block name -> bytes on disk, in least-recently-used order) lives in memory and is
rebuilt from the directory when the tier opens, bounded by entries and time. The LRU order
survives a restart because each write or hit stamps the file's mtime with a logical clock.
Writes reserve their bytes first: evicting least recently used unpinned blocks to make room,
or skipping the write when pinned blocks (and writes under way) leave no room.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Final

from . import blockfile
from .config import TierSpec

DIR_MODE: Final = 0o700
NAME: Final = re.compile(r"[0-9a-f]{64}")


class TierError(Exception):
    """A tier directory that is not safe to use; str() names it and the fix."""


class Written(Enum):
    WRITTEN = "written"
    PRESENT = "present"  # already there: touched instead
    SKIPPED = "skipped"  # pinned blocks and writes under way fill the tier
    TOO_BIG = "too-big"  # larger than the whole tier


@dataclass(frozen=True)
class Rebuilt:
    indexed: int
    temps_removed: int
    leftovers: tuple[str, ...]  # block files past the bound: not indexed, to be removed
    evicted: int  # indexed blocks over the cap (the cap shrank)


def _open_directory(path: Path) -> int:
    missing = []
    here = path
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    for directory in reversed(missing):
        os.mkdir(directory, DIR_MODE)
        os.chmod(directory, DIR_MODE)  # whatever the umask says
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise TierError(f"{path}: {exc.strerror} (a tier must be a real directory)") from None
    info = os.fstat(fd)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        os.close(fd)
        raise TierError(
            f"{path} has owner {info.st_uid} and mode {stat.S_IMODE(info.st_mode):04o}; "
            f"it must be owned by uid {os.geteuid()} with mode 0700"
        )
    return fd


class Tier:
    """A byte-capped directory of block files; thread-safe."""

    def __init__(self, spec: TierSpec, fault: blockfile.Fault | None = None) -> None:
        self.name = spec.name
        self.directory = spec.directory
        self.max_bytes = spec.max_bytes
        self.direct = True  # cleared when the file system refuses O_DIRECT
        self._fault = fault
        self._fd = _open_directory(spec.directory)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # oldest first
        self._pins: Counter[str] = Counter()
        self._reserved = 0  # bytes of writes under way
        self._used = 0  # bytes of indexed blocks
        self._clock = 0

    def close(self) -> None:
        os.close(self._fd)

    # --- the index -------------------------------------------------------------------------

    def rebuild(self, max_entries: int, max_seconds: float) -> Rebuilt:
        """Index the directory's block files (oldest stamp first), remove temp files."""
        deadline = time.monotonic() + max_seconds
        found: list[tuple[int, str, int]] = []
        leftovers: list[str] = []
        temps = 0
        with os.scandir(self._fd) as entries:
            for entry in entries:
                if entry.name.startswith(blockfile.TEMP_PREFIX):
                    self._unlink(entry.name)
                    temps += 1
                elif NAME.fullmatch(entry.name):
                    if len(found) >= max_entries or time.monotonic() > deadline:
                        leftovers.append(entry.name)
                        continue
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(info.st_mode):
                        found.append((info.st_mtime_ns, entry.name, info.st_size))
        found.sort()
        with self._lock:
            self._index.clear()
            self._used = 0
            for stamp, name, size in found:
                self._index[name] = size
                self._used += size
                self._clock = max(self._clock, stamp)
            evicted = self._evict_locked(0)
        if evicted is None:
            evicted = []
        for name in evicted:
            self._unlink(name)
        return Rebuilt(len(found), temps, tuple(leftovers), len(evicted))

    def index(self) -> list[tuple[str, int]]:
        """(block name, bytes) from least to most recently used."""
        with self._lock:
            return list(self._index.items())

    @property
    def used(self) -> int:
        with self._lock:
            return self._used + self._reserved

    def contains(self, name: str) -> bool:
        with self._lock:
            return name in self._index

    def on_disk(self, name: str) -> bool:
        """Whether the block file exists (for a process that does not own the index)."""
        try:
            os.stat(name, dir_fd=self._fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    # --- pins --------------------------------------------------------------------------------

    def pin(self, name: str) -> None:
        with self._lock:
            self._pins[name] += 1

    def unpin(self, name: str) -> None:
        with self._lock:
            self._pins[name] -= 1
            if self._pins[name] <= 0:
                del self._pins[name]

    def pinned(self, name: str) -> bool:
        with self._lock:
            return name in self._pins

    # --- reads and writes -------------------------------------------------------------------

    def read(self, name: str) -> bytes:
        """The block's payload (and it becomes most recently used); raises blockfile.Missing
        or blockfile.Short."""
        data = blockfile.read(self._fd, name, self.direct)
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
                self._stamp_locked(name)
        return data

    def write(
        self, name: str, payload: bytes, on_evict: Callable[[int], None] | None = None
    ) -> Written:
        """Store a block, evicting least recently used unpinned blocks to fit it."""
        size = blockfile.disk_size(len(payload))
        if size > self.max_bytes:
            return Written.TOO_BIG
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
                self._stamp_locked(name)
                return Written.PRESENT
            evicted = self._evict_locked(size)
            if evicted is not None:
                self._reserved += size
        if evicted is None:
            return Written.SKIPPED
        for victim in evicted:
            self._unlink(victim)
        if on_evict is not None and evicted:
            on_evict(len(evicted))
        try:
            written, self.direct = blockfile.write(
                self._fd, name, payload, self.direct, self._fault
            )
        except BaseException:
            with self._lock:
                self._reserved -= size
            raise
        with self._lock:
            self._reserved -= size
            self._used += written - self._index.pop(name, 0)
            self._index[name] = written
            self._stamp_locked(name)
        return Written.WRITTEN

    def discard(self, name: str) -> None:
        """Forget a block and remove its file (it did not open)."""
        with self._lock:
            self._used -= self._index.pop(name, 0)
        self._unlink(name)

    # --- internals ---------------------------------------------------------------------------

    def _evict_locked(self, need: int) -> list[str] | None:
        """Names to evict so that `need` more bytes fit, taken out of the index; None (and
        nothing evicted) when pinned blocks and writes under way leave too little room."""
        free = self.max_bytes - self._used - self._reserved
        if free >= need:
            return []
        victims = []
        for name, size in self._index.items():
            if name in self._pins:
                continue
            victims.append(name)
            free += size
            if free >= need:
                break
        if free < need:
            return None
        for name in victims:
            self._used -= self._index.pop(name)
        return victims

    def _stamp_locked(self, name: str) -> None:
        """Record the LRU position in the file's mtime (a logical clock), for a restart."""
        self._clock = max(self._clock + 1, time.time_ns())
        with contextlib.suppress(FileNotFoundError):
            os.utime(name, ns=(self._clock, self._clock), dir_fd=self._fd, follow_symlinks=False)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._fd)
