"""The local GGUF cache's sync: each Ready library model's files, copied into <cache>/<model name>/.

The library may be a slow network share; the cache is a local disk the router container mounts
read-only. A sync copies what is new or changed, skips what is unchanged without reading it,
removes the models it copied earlier that are no longer Ready, and names the files it refused.

Only what the sync itself created is ever removed: the manifest (cache_manifest.py) records each
copied file. A file is unchanged when its source still has the recorded size and mtime_ns and
the copy still exists with its recorded size; then not even its 8-byte header is read again.
Each file is copied by fastcopy.copy_file (atomic, by the kernel's fast paths, in chunks).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from supervisor.engines.llama_router.cache_manifest import (
    BadFile,
    ManifestFile,
    ManifestModel,
    load_manifest,
    save_manifest,
)
from supervisor.engines.llama_router.fastcopy import CHUNK_SIZE, copy_file, remove_partials_in
from supervisor.errors import Cancelled
from supervisor.library import ggufcheck
from supervisor.library.ggufcheck import Rejected, Unit
from supervisor.library.models import Library
from supervisor.protocol.files import ensure_dir

PROGRESS_INTERVAL: Final = 0.5  # seconds between progress messages, at most
CACHE_DIR_MODE: Final = 0o755
SUMMARY_BAD: Final = 5  # bad files named in the one-line summary; the rest are counted

Progress = Callable[[str], None]


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


def library_units(library: Library) -> tuple[dict[str, tuple[str, Unit]], list[Rejected]]:
    """The units a sync would copy, by name, each with its library model's guid, and the files
    refused by name alone (reads nothing): a name two library models give is the first's."""
    units: dict[str, tuple[str, Unit]] = {}
    rejected: list[Rejected] = []
    for model in library.models:
        grouping = ggufcheck.group(model.files)
        rejected.extend(grouping.rejected)
        for unit in grouping.units:
            if unit.name in units:
                owner = units[unit.name][0]
                reason = f"model name {unit.name} is already used by library model {owner}"
                rejected.extend(Rejected(path, reason) for path in unit.shards)
            else:
                units[unit.name] = (model.guid, unit)
    return units, rejected


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

    units, rejected = library_units(library)
    bad.extend(rejected)

    plans = []
    for name, (guid, unit) in sorted(units.items()):
        plan = _plan_unit(cache_dir, guid, unit, records.get(name), verdicts=verdicts, bad=bad)
        if plan is not None:
            plans.append(plan)

    removed = _remove_stale(cache_dir, records, {p.unit.name: p for p in plans})
    if removed or records != manifest.models or verdicts.new != manifest.bad:
        save_manifest(cache_dir, records, verdicts.new)

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
            remove_partials_in(cache_dir / name)
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
        save_manifest(cache_dir, records, bad_files)  # a crash now leaves a manifest that knows it
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
            remove_partials_in(Path(entry.path))


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
