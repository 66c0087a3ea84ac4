"""One disk tier: a directory of block files under a byte cap, LRU of unpinned blocks, pins.

The index (block name -> bytes on disk, in least-recently-used order) lives in memory and is
rebuilt from the directory when the tier opens, bounded by entries and time. The LRU order
survives a restart because each write or hit stamps the file's mtime with a logical clock.
Writes reserve their bytes first: evicting least recently used unpinned blocks to make room,
or skipping the write when pinned blocks (and writes under way) leave no room. An evicted or
discarded block's bytes stay counted until its file is gone, so the files on disk never hold
more than the cap, and a block is not written again while its old file is being removed.

A rebuild that runs out of time leaves the rest of the directory to finish_rebuild (the
store's writer for the tier runs it while the engine serves; a block not yet indexed is a
miss): no block is removed for lack of time. A disk that something else filled refuses a write
(ENOSPC) while the tier's own count shows room: fit_disk lowers the cap to what the disk holds
and evicts down to it; the cap rises again as the disk frees up.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Final, TypeVar

from . import blockfile
from .config import TierSpec

DIR_MODE: Final = 0o700
NAME: Final = re.compile(r"[0-9a-f]{64}")
UNLINK: Final = "unlink"  # the fault step before a block file is removed
DISK_RECHECK: Final = 10.0  # seconds between looks at the free space while the disk is short
T = TypeVar("T")
Entry = tuple[int, str, int]  # (mtime stamp, block name, bytes on disk)


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
    indexed: int  # block files indexed by this call
    temps_removed: int
    evicted: int  # the least recently used blocks over the cap (it shrank) or the entry bound
    pending: bool  # time ran out: finish_rebuild indexes the rest


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
        self._disk_cap: int | None = None  # what the disk holds, after it refused a write
        self._disk_checked = 0.0
        self._max_entries = 0
        self._scan: Iterator[os.DirEntry[str]] | None = None  # a rebuild's rest, if pending
        self._stamps: dict[str, int] = {}  # scanned, not touched since: their file's stamp

    def close(self) -> None:
        os.close(self._fd)

    # --- the index -------------------------------------------------------------------------

    def rebuild(self, max_entries: int, max_seconds: float) -> Rebuilt:
        """Index the directory's block files (oldest stamp first) and remove temp files, for
        up to max_seconds; when time runs out the rest is pending (finish_rebuild). At most
        max_entries are kept: the least recently used beyond them are evicted."""
        deadline = time.monotonic() + max_seconds
        self._max_entries = max_entries
        self._scan = os.scandir(self._fd)
        return self._index_scanned(deadline)

    @property
    def rebuilding(self) -> bool:
        """Whether a rebuild has files left to index."""
        return self._scan is not None

    def finish_rebuild(self) -> Rebuilt:
        """Index the rest of a rebuild that ran out of time (nothing when none is pending)."""
        if self._scan is None:
            return Rebuilt(0, 0, 0, False)
        return self._index_scanned(float("inf"))

    def _index_scanned(self, deadline: float) -> Rebuilt:
        scan = self._scan
        assert scan is not None
        found: list[Entry] = []
        temps = 0
        done = True
        try:
            for entry in scan:
                if entry.name.startswith(blockfile.TEMP_PREFIX):
                    self._unlink(entry.name)
                    temps += 1
                elif NAME.fullmatch(entry.name):
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISREG(info.st_mode):
                        found.append((info.st_mtime_ns, entry.name, info.st_size))
                if time.monotonic() > deadline:
                    done = False
                    break
        except BaseException:
            self._end_scan()
            raise
        if done:
            self._end_scan()
        with self._lock:
            self._merge_locked(found, final=done)
            evicted = self._evict_locked(0) or []
            if done:
                evicted += self._evict_entries_locked()
        self._remove(evicted)
        return Rebuilt(len(found), temps, len(evicted), not done)

    def _end_scan(self) -> None:
        scan, self._scan = self._scan, None
        if scan is not None:
            scan.close()  # type: ignore[attr-defined]

    def _merge_locked(self, found: list[Entry], *, final: bool) -> None:
        """Put scanned files into the index by their stamps: blocks read or written since the
        scan began stay the most recently used, in their order."""
        old = [
            (self._stamps[name], name, size)
            for name, size in self._index.items()
            if name in self._stamps
        ]
        fresh = [(name, size) for name, size in self._index.items() if name not in self._stamps]
        busy = self._index.keys() | self._removing.keys() | self._writing
        merged = sorted(old + [entry for entry in found if entry[1] not in busy])
        self._index = OrderedDict((name, size) for _, name, size in merged)
        self._index.update(fresh)
        self._used = sum(self._index.values())
        if merged:
            self._clock = max(self._clock, merged[-1][0])
        self._stamps = {} if final else {name: stamp for stamp, name, _ in merged}

    def _evict_entries_locked(self) -> list[str]:
        """The least recently used unpinned blocks beyond the entry bound, out of the index."""
        over = len(self._index) - self._max_entries
        if over <= 0:
            return []
        unpinned = (name for name in self._index if name not in self._pins)  # oldest first
        victims = [name for _, name in zip(range(over), unpinned, strict=False)]
        for name in victims:
            size = self._index.pop(name)
            self._used -= size
            self._removing_locked(name, size)
        return victims

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
        data = self.read_with(name, bytes)
        self.touch(name)
        return data

    def read_with(self, name: str, use: Callable[[memoryview], T], limit: int | None = None) -> T:
        """What `use` makes of the block's payload, a view valid only until `use` returns
        (blockfile.read_with; a file over `limit` bytes is blockfile.Short). Raises
        blockfile.Missing or blockfile.Short, or what `use` raises. touch() makes it the most
        recently used."""
        return blockfile.read_with(self._fd, name, self.direct, use, limit)

    def touch(self, name: str) -> None:
        """Make an indexed block the most recently used (its file's stamp too, for a restart)."""
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)
                self._stamp_locked(name)

    def write(
        self, name: str, payload: bytes, on_evict: Callable[[int], None] | None = None
    ) -> Written:
        """Store a block, evicting least recently used unpinned blocks to fit it."""
        size = blockfile.disk_size(len(payload))
        if size > self.max_bytes:
            return Written.TOO_BIG
        self._recheck_disk()
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
            self._stamps.pop(name, None)
            self._used -= size
            self._removing_locked(name, size)
        self._remove([name])

    # --- a disk that something else filled ----------------------------------------------------

    def fit_disk(self, need: int) -> int:
        """After the disk refused a write (ENOSPC) though the cap left room: the cap becomes
        what the disk holds for this tier (its blocks and the free space), and the least
        recently used blocks are evicted until `need` more bytes fit. How many were evicted."""
        free = self._free_bytes()
        with self._lock:
            self._disk_cap = min(self.max_bytes, self._used + self._removing_bytes + free)
            self._disk_checked = time.monotonic()
            victims = self._evict_locked(need) or []
        self._remove(victims)
        return len(victims)

    @property
    def disk_cap(self) -> int | None:
        """The cap the disk sets, below max_bytes, while it is short of space; else None."""
        with self._lock:
            return self._disk_cap

    def _recheck_disk(self) -> None:
        """While the disk is short, look at its free space again every DISK_RECHECK seconds:
        the cap rises with it, back to max_bytes."""
        with self._lock:
            if self._disk_cap is None or time.monotonic() - self._disk_checked < DISK_RECHECK:
                return
            self._disk_checked = time.monotonic()
        free = self._free_bytes()
        with self._lock:
            cap = self._used + self._reserved + self._removing_bytes + free
            self._disk_cap = None if cap >= self.max_bytes else cap

    def _free_bytes(self) -> int:
        info = os.fstatvfs(self._fd)
        return info.f_bavail * info.f_frsize

    # --- internals ---------------------------------------------------------------------------

    def _evict_locked(self, need: int) -> list[str] | None:
        """Names to evict so that `need` more bytes fit, taken out of the index; None (and
        nothing evicted) when pinned blocks, writes and removals under way leave too little
        room. The victims' bytes count as removals until their files are gone."""
        cap = self.max_bytes if self._disk_cap is None else self._disk_cap
        free = cap - self._used - self._reserved - self._removing_bytes
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
        self._stamps.pop(name, None)
        with contextlib.suppress(FileNotFoundError):
            os.utime(name, ns=(self._clock, self._clock), dir_fd=self._fd, follow_symlinks=False)

    def _unlink(self, name: str) -> None:
        if self._fault is not None:
            self._fault(UNLINK)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._fd)
