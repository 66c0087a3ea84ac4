"""The local GGUF cache: each Ready library model's files, copied into <cache>/<model name>/.

The library may be a slow network share; the cache is a local disk the router container mounts
read-only. A sync copies what is new or changed, skips what is unchanged without reading it,
removes the models it copied earlier that are no longer Ready, and names the files it refused.

Only what the sync itself created is ever removed: a manifest (<cache>/.lucia-gguf-cache.json,
written atomically) records each copied file's source path, size and mtime_ns and the copy's
size. A file is unchanged when its source still has that size and mtime_ns and the copy still
exists with its recorded size; then not even its 8-byte header is read again.

Copies are atomic (a temp name in the destination directory, fsync, rename, fsync of the
directory) and use the kernel's fast paths: copy_file_range, then sendfile, then pread/pwrite.
They go in chunks so that progress is reported and cancellation is noticed between chunks.
"""

from __future__ import annotations

import errno
import functools
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.errors import Cancelled
from supervisor.library import ggufcheck
from supervisor.library.ggufcheck import Rejected, Unit
from supervisor.library.models import Library
from supervisor.protocol.files import FileRefused, ensure_dir, fsync_dir, read_text, write_atomic

MANIFEST_NAME: Final = ".lucia-gguf-cache.json"
CHUNK_SIZE: Final = 64 * 1024 * 1024
BUFFER_SIZE: Final = 1024 * 1024  # the pread/pwrite fallback's buffer
PROGRESS_INTERVAL: Final = 0.5  # seconds between progress messages, at most
CACHE_FILE_MODE: Final = 0o644  # the container may read as any uid; models are not secrets
CACHE_DIR_MODE: Final = 0o755
MAX_MANIFEST: Final = 32 * 1024 * 1024
SUMMARY_BAD: Final = 5  # bad files named in the one-line summary; the rest are counted
_PARTIAL: Final = re.compile(r"\..+\.[0-9a-f]{8}\.partial")

Method = Literal["copy_file_range", "sendfile", "pread"]
_METHODS: Final[tuple[Method, ...]] = ("copy_file_range", "sendfile", "pread")
# errnos that mean "this way of copying does not work for these files", not "the copy failed"
_UNSUPPORTED: Final = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}
)

Progress = Callable[[str], None]


# --- the manifest ---------------------------------------------------------------------------


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    size: int = Field(ge=0)
    mtime_ns: int
    dest_size: int = Field(ge=0)


class ManifestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    guid: str
    files: dict[str, ManifestFile]


class BadFile(BaseModel):
    """A source file whose header was read and found bad: not read again while unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(ge=0)
    mtime_ns: int
    reason: str


class Manifest(BaseModel):
    """What the sync copied, by model name then file name; nothing else is ever removed.
    Also the verdicts on bad source files, by source path, so that they are not re-read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    models: dict[str, ManifestModel] = Field(default_factory=dict)
    bad: dict[str, BadFile] = Field(default_factory=dict)


def load_manifest(cache_dir: Path) -> tuple[Manifest, str | None]:
    """The manifest, or an empty one and why when it is absent (None) or unreadable (a line)."""
    path = cache_dir / MANIFEST_NAME
    try:
        manifest = Manifest.model_validate_json(read_text(path, limit=MAX_MANIFEST))
    except FileNotFoundError:
        return Manifest(), None
    except (FileRefused, ValidationError, ValueError) as exc:
        detail = str(exc).splitlines()[0]
        return Manifest(), f"{MANIFEST_NAME} ignored ({detail}); cached files will be copied again"
    # Names come back as paths: keep only entries that are plain names (defence in depth).
    models = {
        name: ManifestModel(
            guid=entry.guid,
            files={f: rec for f, rec in entry.files.items() if _plain(f)},
        )
        for name, entry in manifest.models.items()
        if ggufcheck.name_problem(name) is None
    }
    return Manifest(models=models, bad=manifest.bad), None


def _plain(name: str) -> bool:
    return bool(name) and name not in {".", ".."} and "/" not in name and "\x00" not in name


def _save(cache_dir: Path, models: dict[str, ManifestModel], bad: dict[str, BadFile]) -> None:
    document = Manifest(models=dict(sorted(models.items())), bad=dict(sorted(bad.items())))
    write_atomic(cache_dir / MANIFEST_NAME, (document.model_dump_json(indent=2) + "\n").encode())


# --- copying one file -----------------------------------------------------------------------


class SourceChanged(OSError):
    """The source file changed (size or mtime) while it was being copied."""


@dataclass(frozen=True)
class CopyStats:
    size: int
    mtime_ns: int  # the source's, as it was copied
    method: Method  # the method that copied the last byte


class _Copier:
    """Copies byte ranges between two fds by the fastest method that works for them."""

    def __init__(self) -> None:
        available = {
            "copy_file_range": hasattr(os, "copy_file_range"),
            "sendfile": hasattr(os, "sendfile"),
            "pread": True,
        }
        self._methods = [m for m in _METHODS if available[m]]
        self.method: Method = self._methods[0]

    def _fall_back(self) -> bool:
        index = self._methods.index(self.method)
        if index + 1 == len(self._methods):
            return False
        self.method = self._methods[index + 1]
        return True

    def _once(self, src: int, dst: int, offset: int, count: int) -> int:
        if self.method == "copy_file_range":
            return os.copy_file_range(src, dst, count, offset, offset)
        if self.method == "sendfile":
            os.lseek(dst, offset, os.SEEK_SET)  # sendfile writes at dst's file position
            return os.sendfile(dst, src, offset, count)
        data = os.pread(src, min(count, BUFFER_SIZE), offset)
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.pwrite(dst, view[written:], offset + written)
        return len(data)

    def copy(self, src: int, dst: int, offset: int, count: int) -> int:
        """Copy up to count bytes at offset; fewer only at the source's end of file."""
        done = 0
        while done < count:
            try:
                n = self._once(src, dst, offset + done, count - done)
            except OSError as exc:
                if exc.errno in _UNSUPPORTED and self._fall_back():
                    continue
                raise
            if n == 0:
                # Some filesystems answer 0 from the fast paths instead of an error: make sure
                # with the next method before believing the file ended.
                if self._fall_back():
                    continue
                break
            done += n
        return done


def copy_file(
    src: Path,
    dest: Path,
    *,
    cancel: threading.Event | None = None,
    on_bytes: Callable[[int], None] | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> CopyStats:
    """Copy src to dest atomically: dest is absent or complete, never partial.

    on_bytes(n) is called after each chunk with the bytes copied so far. cancel is checked
    between chunks: a cancelled copy removes its temp file and raises Cancelled. A source that
    changes while being copied raises SourceChanged. Symlinks are not followed.
    """
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        before = os.fstat(sfd)
        if not stat.S_ISREG(before.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(src))
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(sfd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.partial")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        dfd = os.open(tmp, flags, CACHE_FILE_MODE)
        try:
            try:
                os.fchmod(dfd, CACHE_FILE_MODE)
                copier = _Copier()
                size = before.st_size
                offset = 0
                while offset < size:
                    if cancel is not None and cancel.is_set():
                        raise Cancelled(f"cancelled while copying {src.name}")
                    n = copier.copy(sfd, dfd, offset, min(chunk_size, size - offset))
                    if n == 0:
                        raise SourceChanged(errno.EIO, "source shrank while being copied", str(src))
                    offset += n
                    if on_bytes is not None:
                        on_bytes(offset)
                after = os.fstat(sfd)
                if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns):
                    raise SourceChanged(errno.EIO, "source changed while being copied", str(src))
                os.fsync(dfd)
            finally:
                os.close(dfd)
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    finally:
        os.close(sfd)
    fsync_dir(dest.parent)
    return CopyStats(size, before.st_mtime_ns, copier.method)


# --- progress -------------------------------------------------------------------------------


def progress_message(name: str, done: int, total: int) -> str:
    """ "copying NAME 12.3 of 40.0 GB" (decimal GB, one decimal)."""
    return f"copying {name} {done / 1e9:.1f} of {total / 1e9:.1f} GB"


class _Throttle:
    """Passes a message on at most once per interval (the first one at once)."""

    def __init__(self, sink: Progress, clock: Callable[[], float], interval: float) -> None:
        self._sink = sink
        self._clock = clock
        self._interval = interval
        self._last: float | None = None

    def __call__(self, message: str) -> None:
        now = self._clock()
        if self._last is None or now - self._last >= self._interval:
            self._last = now
            self._sink(message)


# --- the sync -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CachedModel:
    """A model complete in the cache; paths relative to the cache directory (for the preset)."""

    name: str
    guid: str
    model_file: str
    mmproj_file: str | None
    files: tuple[str, ...]


@dataclass(frozen=True)
class SyncResult:
    models: tuple[CachedModel, ...]  # complete in the cache now, sorted by name
    copied: tuple[str, ...]  # "<model>/<file>" copied by this sync
    unchanged: tuple[str, ...]  # "<model>/<file>" skipped: already copied and unchanged
    removed: tuple[str, ...]  # model names removed (no longer Ready)
    bad: tuple[Rejected, ...]  # files skipped and never copied, with reasons
    notes: tuple[str, ...] = ()  # other one-line remarks (an unreadable manifest)

    def summary(self) -> str:
        """One line for the status message."""
        parts = [
            f"{len(self.models)} model{'s' if len(self.models) != 1 else ''} in the cache "
            f"({len(self.copied)} files copied, {len(self.unchanged)} unchanged, "
            f"{len(self.removed)} removed)"
        ]
        if self.bad:
            shown = [str(b) for b in self.bad[:SUMMARY_BAD]]
            if len(self.bad) > SUMMARY_BAD:
                shown.append(f"and {len(self.bad) - SUMMARY_BAD} more")
            parts.append("skipped " + "; ".join(shown))
        parts.extend(self.notes)
        return "; ".join(parts)


@dataclass
class _Plan:
    unit: Unit
    guid: str
    copy: list[Path] = field(default_factory=list)
    keep: list[Path] = field(default_factory=list)


def sync(
    library: Library,
    cache_dir: Path,
    progress: Progress,
    cancel: threading.Event,
    *,
    chunk_size: int = CHUNK_SIZE,
    clock: Callable[[], float] = time.monotonic,
) -> SyncResult:
    """Make cache_dir hold exactly the Ready models' usable GGUF files (see the module doc)."""
    ensure_dir(cache_dir, CACHE_DIR_MODE)
    manifest, note = load_manifest(cache_dir)
    records = dict(manifest.models)
    verdicts = _Verdicts(manifest.bad)
    bad: list[Rejected] = []
    _remove_partials(cache_dir)

    units: dict[str, tuple[str, Unit]] = {}
    for model in library.models:
        grouping = ggufcheck.group(model.files)
        bad.extend(grouping.rejected)
        for unit in grouping.units:
            if unit.name in units:
                owner = units[unit.name][0]
                reason = f"model name {unit.name} is already used by library model {owner}"
                bad.extend(Rejected(path, reason) for path in unit.shards)
            else:
                units[unit.name] = (model.guid, unit)

    plans = []
    for name, (guid, unit) in sorted(units.items()):
        plan = _plan_unit(cache_dir, guid, unit, records.get(name), verdicts=verdicts, bad=bad)
        if plan is not None:
            plans.append(plan)

    removed = _remove_stale(cache_dir, records, {p.unit.name: p for p in plans})
    if removed or records != manifest.models or verdicts.new != manifest.bad:
        _save(cache_dir, records, verdicts.new)

    throttle = _Throttle(progress, clock, PROGRESS_INTERVAL)
    copied: list[str] = []
    unchanged: list[str] = []
    complete: list[CachedModel] = []
    for plan in plans:
        unchanged.extend(f"{plan.unit.name}/{p.name}" for p in plan.keep)
        if cancel.is_set():
            raise Cancelled("cancelled while syncing the GGUF cache")
        try:
            done = _copy_unit(
                cache_dir,
                plan,
                records,
                bad_files=verdicts.new,
                throttle=throttle,
                cancel=cancel,
                chunk_size=chunk_size,
            )
        except Cancelled:
            raise
        except OSError as exc:
            where = Path(exc.filename) if isinstance(exc.filename, str) else plan.unit.main
            reason = f"copy failed: {exc.strerror or exc} (model {plan.unit.name} skipped)"
            bad.append(Rejected(where, reason))
            continue
        copied.extend(done)
        complete.append(_cached(plan))
    return SyncResult(
        models=tuple(complete),
        copied=tuple(copied),
        unchanged=tuple(unchanged),
        removed=tuple(removed),
        bad=tuple(sorted(bad, key=lambda r: (r.path.name, r.reason))),
        notes=(note,) if note else (),
    )


def _cached(plan: _Plan) -> CachedModel:
    unit = plan.unit
    return CachedModel(
        name=unit.name,
        guid=plan.guid,
        model_file=f"{unit.name}/{unit.main.name}",
        mmproj_file=f"{unit.name}/{unit.mmproj.name}" if unit.mmproj else None,
        files=tuple(f"{unit.name}/{p.name}" for p in unit.files),
    )


def _unchanged(record: ManifestFile | None, source: Path, info: os.stat_result, dest: Path) -> bool:
    if record is None or record.source != str(source):
        return False
    if (record.size, record.mtime_ns) != (info.st_size, info.st_mtime_ns):
        return False
    try:
        copy = dest.lstat()
    except OSError:
        return False
    return stat.S_ISREG(copy.st_mode) and copy.st_size == record.dest_size == record.size


class _Verdicts:
    """Header checks, remembered for bad files so that an unchanged bad file is not re-read.
    Only a header that was read and found bad is remembered, never an I/O error."""

    def __init__(self, old: dict[str, BadFile]) -> None:
        self.old = old
        self.new: dict[str, BadFile] = {}

    def check(self, path: Path, info: os.stat_result) -> str | None:
        known = self.old.get(str(path))
        if known is not None and (known.size, known.mtime_ns) == (info.st_size, info.st_mtime_ns):
            problem: str | None = known.reason
        else:
            try:
                problem = ggufcheck.header_problem(ggufcheck.read_header(path))
            except ggufcheck.Unreadable as exc:
                return exc.reason
        if problem is not None:
            self.new[str(path)] = BadFile(
                size=info.st_size, mtime_ns=info.st_mtime_ns, reason=problem
            )
        return problem


def _plan_unit(
    cache_dir: Path,
    guid: str,
    unit: Unit,
    record: ManifestModel | None,
    *,
    verdicts: _Verdicts,
    bad: list[Rejected],
) -> _Plan | None:
    """Decide per file: keep (unchanged: nothing read) or copy (header checked first).

    A bad shard drops the whole unit; a bad mmproj drops only the mmproj."""
    plan = _Plan(unit, guid)
    dest_dir = cache_dir / unit.name
    for path in unit.files:
        problem = None
        try:
            info = path.lstat()
        except OSError as exc:
            problem = f"cannot be read: {exc.strerror}"
        else:
            previous = record.files.get(path.name) if record else None
            if _unchanged(previous, path, info, dest_dir / path.name):
                plan.keep.append(path)
                continue
            problem = verdicts.check(path, info)
        if problem is None:
            plan.copy.append(path)
        elif path == unit.mmproj:
            bad.append(Rejected(path, f"{problem} ({unit.name} is served without it)"))
            plan.unit = Unit(unit.name, unit.shards, None)
        else:
            bad.append(Rejected(path, f"{problem} (model {unit.name} skipped)"))
            return None
    return plan


def _remove_stale(
    cache_dir: Path, records: dict[str, ManifestModel], plans: dict[str, _Plan]
) -> list[str]:
    """Remove recorded models that are gone and recorded files a kept model no longer has.
    Only files the manifest records are removed; a directory only when that leaves it empty."""
    removed = []
    for name, record in sorted(records.items()):
        plan = plans.get(name)
        wanted = {p.name for p in plan.unit.files} if plan else set()
        stale = {f for f in record.files if f not in wanted}
        if plan is not None and not stale:
            continue
        for file_name in sorted(stale):
            _unlink_file(cache_dir / name / file_name)
        if plan is None:
            _remove_partials_in(cache_dir / name)
            _rmdir_if_empty(cache_dir / name)
            del records[name]
            removed.append(name)
        else:
            files = {f: r for f, r in record.files.items() if f not in stale}
            records[name] = ManifestModel(guid=record.guid, files=files)
    return removed


def _copy_unit(
    cache_dir: Path,
    plan: _Plan,
    records: dict[str, ManifestModel],
    *,
    bad_files: dict[str, BadFile],
    throttle: _Throttle,
    cancel: threading.Event,
    chunk_size: int,
) -> list[str]:
    if not plan.copy:
        return []
    name = plan.unit.name
    dest_dir = cache_dir / name
    try:
        info = dest_dir.lstat()
    except FileNotFoundError:
        ensure_dir(dest_dir, CACHE_DIR_MODE)
    else:
        if not stat.S_ISDIR(info.st_mode):
            raise OSError(errno.ENOTDIR, f"{dest_dir} is not a directory", str(dest_dir))
    total = sum(path.lstat().st_size for path in plan.copy)
    base = 0
    throttle(progress_message(name, 0, total))
    copied = []
    for path in plan.copy:
        stats = copy_file(
            path,
            dest_dir / path.name,
            cancel=cancel,
            on_bytes=functools.partial(_report, throttle, name, base, total),
            chunk_size=chunk_size,
        )
        base += stats.size
        previous = records.get(name)
        files = dict(previous.files) if previous else {}
        files[path.name] = ManifestFile(
            source=str(path), size=stats.size, mtime_ns=stats.mtime_ns, dest_size=stats.size
        )
        records[name] = ManifestModel(guid=plan.guid, files=dict(sorted(files.items())))
        _save(cache_dir, records, bad_files)  # a crash now leaves a manifest that knows it
        copied.append(f"{name}/{path.name}")
    return copied


def _report(throttle: _Throttle, name: str, base: int, total: int, done: int) -> None:
    throttle(progress_message(name, base + done, total))


def _remove_partials(cache_dir: Path) -> None:
    """Remove temp files an interrupted copy left (only names this module creates)."""
    try:
        entries = list(os.scandir(cache_dir))
    except OSError:
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            _remove_partials_in(Path(entry.path))


def _remove_partials_in(directory: Path) -> None:
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if _PARTIAL.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)


def _unlink_file(path: Path) -> None:
    try:
        if stat.S_ISREG(path.lstat().st_mode):
            path.unlink()
    except FileNotFoundError:
        pass


def _rmdir_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()
    except OSError as exc:
        if exc.errno not in {errno.ENOENT, errno.ENOTEMPTY, errno.ENOTDIR}:
            raise
