"""One disk tier: a directory of block files under a byte cap, LRU of unpinned blocks, pins.

The index (block name -> bytes on disk, in least-recently-used order) lives in memory and is
rebuilt from the directory when the tier opens, bounded by entries and time. The LRU order
survives a restart because each write or hit stamps the file's mtime with a logical clock.
Writes reserve their bytes first: evicting least recently used unpinned blocks to make room,
or skipping the write when pinned blocks (and writes under way) leave no room. An evicted or
discarded block's bytes stay counted until its file is gone, so the files on disk never hold
more than the cap, and a block is not written again while its old file is being removed.
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
from typing import Final, TypeVar

from . import blockfile
from .config import TierSpec

DIR_MODE: Final = 0o700
NAME: Final = re.compile(r"[0-9a-f]{64}")
UNLINK: Final = "unlink"  # the fault step before a block file is removed
T = TypeVar("T")


class TierError(Exception):
    """A tier directory that is not safe to use; str() names it and the fix."""


class Written(Enum):
    WRITTEN = "written"
    PRESENT = "present"  # already there (touched instead), or being written by another
    SKIPPED = "skipped"  # pinned blocks and writes under way fill the tier, or its old file
    # is being removed
    TOO_BIG = "too-big"  # larger than the whole tier


@dataclass(frozen=True)
class Rebuilt:
    indexed: int
    temps_removed: int
    leftovers: tuple[str, ...]  # block files past the bound: not indexed, to be removed
    evicted: int  # indexed blocks over the cap (the cap shrank)


def _make_directories(path: Path) -> None:
    """Create the missing directories of the path, owner-only. Another process (a rank of the
    same engine) may create one at the same time: that one must be a directory of ours."""
    missing = []
    here = path
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:
            _check_made_by_another(directory)
            continue
        os.chmod(directory, DIR_MODE)  # whatever the umask says


def _check_made_by_another(directory: Path) -> None:
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise TierError(f"{directory} appeared and is not a directory (a tier must be one)")
    if info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise TierError(
            f"{directory} appeared with owner {info.st_uid} and mode "
            f"{stat.S_IMODE(info.st_mode):04o}; it must be owned by uid {os.geteuid()} "
            "with mode 0700"
        )


def _open_directory(path: Path) -> int:
    _make_directories(path)
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
        """`fault` is called before each step of a write (blockfile.STEPS) and with UNLINK
        before a file is removed, for fault injection."""
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
        self._writing: set[str] = set()  # names with a write under way
        self._removing: dict[str, int] = {}  # out of the index, file not yet removed: bytes
        self._removing_bytes = 0
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
            evicted = self._evict_locked(0) or []
        self._remove(evicted)
        return Rebuilt(len(found), temps, tuple(leftovers), len(evicted))

    def index(self) -> list[tuple[str, int]]:
        """(block name, bytes) from least to most recently used."""
        with self._lock:
            return list(self._index.items())

    @property
    def used(self) -> int:
        """Bytes counted against the cap: indexed blocks, writes and removals under way. While
        a write's victims are being removed, both they and the write count: more than the cap
        for that moment, though the files never hold more (the victims go first)."""
        with self._lock:
            return self._used + self._reserved + self._removing_bytes

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
        return self.read_with(name, bytes)

    def read_with(self, name: str, use: Callable[[memoryview], T]) -> T:
        """What `use` makes of the block's payload, a view valid only until `use` returns
        (blockfile.read_with); the block becomes most recently used. Raises
        blockfile.Missing or blockfile.Short, or what `use` raises."""
        data = blockfile.read_with(self._fd, name, self.direct, use)
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
            if name in self._writing:
                return Written.PRESENT  # one file per name under way: evictions see it whole
            if name in self._removing:
                return Written.SKIPPED  # a new file now could go with the old one
            evicted = self._evict_locked(size)
            if evicted is None:
                return Written.SKIPPED
            self._reserved += size
            self._writing.add(name)
        try:
            self._remove(evicted)
            if on_evict is not None and evicted:
                on_evict(len(evicted))
            written, self.direct = blockfile.write(
                self._fd, name, payload, self.direct, self._fault
            )
        except blockfile.Unsynced as exc:
            self.direct = exc.direct
            with self._lock:
                self._written_locked(name, size)
                self._index_locked(name, exc.size)  # in place: counted like any other
            raise
        except BaseException:
            with self._lock:
                self._written_locked(name, size)
            raise
        with self._lock:
            self._written_locked(name, size)
            self._index_locked(name, written)
        return Written.WRITTEN

    def discard(self, name: str) -> None:
        """Forget a block and remove its file (it did not open)."""
        with self._lock:
            if name in self._removing or name in self._writing:
                return  # going already, or about to be replaced whole
            size = self._index.pop(name, 0)
            self._used -= size
            self._removing_locked(name, size)
        self._remove([name])

    # --- internals ---------------------------------------------------------------------------

    def _evict_locked(self, need: int) -> list[str] | None:
        """Names to evict so that `need` more bytes fit, taken out of the index; None (and
        nothing evicted) when pinned blocks, writes and removals under way leave too little
        room. The victims' bytes count as removals until their files are gone."""
        free = self.max_bytes - self._used - self._reserved - self._removing_bytes
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
            size = self._index.pop(name)
            self._used -= size
            self._removing_locked(name, size)
        return victims

    def _written_locked(self, name: str, reserved: int) -> None:
        self._reserved -= reserved
        self._writing.discard(name)

    def _index_locked(self, name: str, size: int) -> None:
        self._used += size - self._index.pop(name, 0)
        self._index[name] = size
        self._stamp_locked(name)

    def _removing_locked(self, name: str, size: int) -> None:
        self._removing[name] = size
        self._removing_bytes += size

    def _remove(self, names: list[str]) -> None:
        """Remove files taken out of the index; their bytes stop counting once each is gone.
        A file that stays (the disk refused) goes back into the index as the least recently
        used, still counted, and the first error is raised."""
        gone: set[str] = set()
        errors: list[OSError] = []
        try:
            for name in names:
                try:
                    self._unlink(name)
                except OSError as exc:
                    errors.append(exc)
                else:
                    gone.add(name)
        finally:
            with self._lock:
                for name in names:
                    size = self._removing.pop(name)
                    self._removing_bytes -= size
                    if name not in gone and size:
                        self._index[name] = size
                        self._index.move_to_end(name, last=False)
                        self._used += size
        if errors:
            raise errors[0]

    def _stamp_locked(self, name: str) -> None:
        """Record the LRU position in the file's mtime (a logical clock), for a restart."""
        self._clock = max(self._clock + 1, time.time_ns())
        with contextlib.suppress(FileNotFoundError):
            os.utime(name, ns=(self._clock, self._clock), dir_fd=self._fd, follow_symlinks=False)

    def _unlink(self, name: str) -> None:
        if self._fault is not None:
            self._fault(UNLINK)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._fd)
