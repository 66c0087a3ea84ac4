"""Old KV-cache namespaces on a tier root: which go, and the locks that keep the others.

Prune removes the namespace directories of a tier root other than the current one, oldest
(last changed) first, while the room the current one is promised (its cap) and the others'
bytes exceed the tier's cap. It never removes a namespace that
- a container names (its `lucia.vllm.kv-namespace` label): any container on this Docker,
  running or not, of any engine, so another engine on the same root keeps its namespace from
  the moment its container is created, long before vLLM's store takes its lock;
- a worker is starting an engine on: the worker holds a shared flock on the namespace
  directory itself from the Check before a start until the container exists or the start is
  abandoned (`Starting`), the window in which neither a container nor a store names it;
- a store holds: the plugin's owner lock (`OWNER_LOCK`, lucia_kv.owner), in the namespace
  directory or a rank's below it, taken once vLLM builds its connector (after the weights).

The order closes the windows between the three. A prune holds a flock on the tier root itself
exclusively for its whole run; a starting worker holds it shared while it makes its directory
and locks it, so no start is marked while a prune looks. The prune tries every old namespace's
directory lock first, then lists the containers, so a container whose worker let go of its lock
before the prune took it is listed, and only then tries the owner locks of namespaces no
container names (never one of an engine still loading). Every lock a prune takes is held until
its removals are done, so nothing takes one while a namespace goes; a lock that does not open
counts as held, and a listing that fails removes nothing. Locks on directories write nothing (no
marker file to leave behind or to count) and go with the directory they lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor import logs
from supervisor.docker.runtime import Runtime
from supervisor.engines.base import StepContext
from supervisor.engines.vllm import tiers
from supervisor.errors import Permanent, Transient

LABEL: Final = "lucia.vllm.kv-namespace"  # on an engine container: the namespace it mounts
OWNER_LOCK: Final = ".lucia-kv-owner"  # the plugin's lock file (lucia_kv.owner.LOCK_NAME)
_FILE: Final = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_DIRECTORY: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
log = logs.get("vllm")


@dataclass(frozen=True)
class Old:
    """An old namespace directory as a prune found it, and who keeps it."""

    path: Path
    changed: int  # its last change, in ns
    size: int  # the bytes its files hold on disk
    named: bool = False  # a container's label names it
    starting: bool = False  # a worker starting an engine on it holds its directory
    owned: bool = False  # a store holds an owner lock in it

    @property
    def held(self) -> bool:
        return self.named or self.starting or self.owned


def chosen(found: Iterable[Old], cap: int, reserve: int) -> list[Path]:
    """Pure: the old namespaces to remove, oldest first, while the room the current one is
    promised (reserve) and the old ones' bytes exceed the cap. Held ones stay and count."""
    ordered = sorted(found, key=lambda old: (old.changed, old.path.name))
    total = sum(old.size for old in ordered)
    removed = []
    for old in ordered:
        if reserve + total <= cap:
            break
        if old.held:
            continue
        total -= old.size
        removed.append(old.path)
    return removed


def size(path: Path) -> int:
    """What a namespace directory holds on disk (its files' allocated bytes, links not
    followed)."""
    total = 0
    for top, dirs, names in os.walk(path, followlinks=False):
        for name in (*names, *dirs):
            try:
                info = os.lstat(os.path.join(top, name))
            except FileNotFoundError:
                continue
            total += info.st_blocks * 512 if not stat.S_ISDIR(info.st_mode) else 0
    return total


def _take(locks: contextlib.ExitStack, path: Path, operation: int, flags: int = _FILE) -> bool:
    """Take a flock on a lock file (or a directory), held until locks closes. Whether nobody
    else holds it: a file that is not there is held by nobody; one that does not open (a
    symbolic link) or lock is held."""
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    locks.callback(os.close, fd)
    try:
        fcntl.flock(fd, operation)
    except OSError:
        return False
    return True


def _unowned(locks: contextlib.ExitStack, path: Path) -> bool:
    """Whether no store holds an owner lock in a namespace directory (its own, or a rank's
    below it); the locks taken are held until locks closes."""
    for top, _dirs, names in os.walk(path, followlinks=False):
        if OWNER_LOCK in names and not _take(
            locks, Path(top, OWNER_LOCK), fcntl.LOCK_EX | fcntl.LOCK_NB
        ):
            return False
    return True


def _found(root: Path, space: str) -> list[tuple[Path, int, int]]:
    found = []
    for path in tiers.stale(root, space):
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(path)
            if stat.S_ISDIR(info.st_mode):
                found.append((path, info.st_mtime_ns, size(path)))
    return found


def prune(
    root: Path, space: str, cap: int, reserve: int, named: Callable[[], Collection[str]]
) -> list[Path]:
    """Remove old namespaces under a tier root, oldest first, while the tier's cap needs their
    room (chosen), never one a container names (named() lists them: the namespaces of every
    container, asked once the starts' locks are tried), a worker is starting or a store holds.
    Returns what was removed; a named() that raises removes nothing and raises."""
    if not os.path.isdir(root) or os.path.islink(root):
        return []
    with contextlib.ExitStack() as locks:
        if not _take(locks, root, fcntl.LOCK_EX, _DIRECTORY):
            return []
        found = _found(root, space)
        starting = {
            path.name
            for path, _, _ in found
            if not _take(locks, path, fcntl.LOCK_EX | fcntl.LOCK_NB, _DIRECTORY)
        }
        listed = frozenset(named())
        old = []
        for path, changed, on_disk in found:
            kept = path.name in listed or path.name in starting
            old.append(
                Old(
                    path,
                    changed,
                    on_disk,
                    named=path.name in listed,
                    starting=path.name in starting,
                    owned=not kept and not _unowned(locks, path),
                )
            )
        removed = chosen(old, cap, reserve)
        for path in removed:
            shutil.rmtree(path)
        return removed


def named(runtime: Runtime) -> frozenset[str]:
    """The namespaces the containers on this Docker name: every container, running or not
    (created, not yet started, or exited), of any engine of any worker."""
    return frozenset(
        found.labels[LABEL]
        for found in runtime.containers(LABEL, running=False)
        if found.labels.get(LABEL)
    )


def prune_tiers(
    runtime: Runtime, disks: Iterable[tiers.DiskTier], space: str, ctx: StepContext | None
) -> None:
    """Prune each disk tier for the current namespace (its cap is what it is promised),
    saying what went; a tier whose containers Docker did not list keeps everything."""
    for tier in disks:
        try:
            gone = prune(tier.root, space, tier.max_bytes, tier.max_bytes, lambda: named(runtime))
        except (Transient, Permanent) as exc:
            log.warning(
                "old KV-cache namespaces kept: the containers were not listed",
                tier=tier.name,
                error=str(exc),
            )
            continue
        for path in gone:
            log.info("old KV-cache namespace removed", tier=tier.name, namespace=path.name)
            if ctx is not None:
                ctx.progress(f"KV-cache tier {tier.name}: removed old namespace {path.name}")


class Starting:
    """The namespaces this worker is starting an engine on: a shared flock on each namespace
    directory, taken with the directory made (again, should a prune have removed it since it
    was observed) and held until release(): once the container exists (it names the namespace
    from then on), or the start is abandoned. Shared: two workers starting on one namespace
    both hold it (the plugin's owner lock refuses the second store itself)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[Path, int] = {}

    def hold(self, root: Path, space: str, uid: int | None = None) -> Path:
        """Make the namespace's directory under root and hold its lock; the directory."""
        root_fd = tiers.open_root(root, uid)
        try:
            fcntl.flock(root_fd, fcntl.LOCK_SH)  # no prune runs on the root meanwhile
            directory = tiers.prepare(root, space, uid)
            try:
                fd = os.open(directory, _DIRECTORY)
            except OSError as exc:
                raise tiers.TierRefused(f"{directory}: {exc.strerror}") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(root_fd)  # and its lock with it
        with self._lock:
            before = self._held.pop(directory, None)
            self._held[directory] = fd
        if before is not None:
            os.close(before)
        return directory

    def hold_tiers(self, disks: Iterable[tiers.DiskTier], space: str, ctx: StepContext) -> None:
        """hold() on each disk tier, saying where; a directory refused is Permanent."""
        for tier in disks:
            try:
                made = self.hold(tier.root, space)
            except tiers.TierRefused as exc:
                raise Permanent(f"KV-cache tier {tier.name}: {exc}") from None
            ctx.progress(f"KV-cache tier {tier.name}: {made}")

    def held(self) -> tuple[Path, ...]:
        with self._lock:
            return tuple(self._held)

    def release(self) -> None:
        """Let go of every namespace held (nothing, when none is)."""
        with self._lock:
            fds, self._held = list(self._held.values()), {}
        for fd in fds:
            os.close(fd)
