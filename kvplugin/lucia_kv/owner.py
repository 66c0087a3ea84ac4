"""One owner per tier directory: an exclusive lock held for a store's life.

Two stores on one directory (two engines of the same namespace, or data-parallel ranks sharing
one) would keep two indexes, caps and pin sets, and fill it to twice its cap. Each store takes
an exclusive flock(2) on LOCK_NAME in each of its tier directories and holds it until it closes
(or its process ends); a second store is refused with the holder's pid, host and container.
flock works across processes and across containers on one kernel (a bind-mounted host
directory). The supervisor's prune tries the same lock by the same file name and never removes
a namespace whose lock is held.

The holder's line is written into the lock file in place, not by rename: the lock belongs to
the file's inode, so the file must stay. A store refused in the instant between another's lock
and its write reads no holder, and says so.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
from collections.abc import Iterable
from pathlib import Path
from typing import Final

LOCK_NAME: Final = ".lucia-kv-owner"  # the supervisor's namespaces.OWNER_LOCK names the same file
_CONTAINER = re.compile(r"containers/([0-9a-f]{64})/")


class OwnerError(Exception):
    """The lock file cannot be opened; str() names it and why, errno the OS error's number."""

    def __init__(self, message: str, number: int | None = None) -> None:
        super().__init__(message)
        self.errno = number


class Taken(OwnerError):
    """Another store holds the directory; str() names it and the holder."""


def holder() -> str:
    """This process as a lock's holder: pid, host name, and container id where there is one."""
    found = f"pid {os.getpid()} on host {socket.gethostname()}"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            match = _CONTAINER.search(handle.read())
    except OSError:
        match = None
    return f"{found} in container {match.group(1)[:12]}" if match else found


class Owner:
    """The held lock of one directory; release() (or the process's end) frees it."""

    __slots__ = ("_fd", "directory")

    def __init__(self, fd: int, directory: Path) -> None:
        self._fd = fd
        self.directory = directory

    def __repr__(self) -> str:
        return f"Owner({self.directory})"

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = -1


def claim(directory: Path) -> Owner:
    """Own the directory, or raise Taken naming the store that does."""
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise OwnerError(f"the owner lock {path}: {exc.strerror}", exc.errno) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        line = ""
        with contextlib.suppress(OSError):
            line = os.pread(fd, 512, 0).decode(errors="replace").strip()
        os.close(fd)
        raise Taken(
            f"{directory} is in use by another KV-cache store ({line or 'holder not yet written'})"
            ": each engine, and each data-parallel rank, needs a namespace directory of its own; "
            "stop the other engine or give this one another namespace"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise OwnerError(f"the owner lock {path}: {exc.strerror}", exc.errno) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (holder() + "\n").encode(), 0)
    except OSError as exc:  # a full or failing disk: the lock is not kept, nor its descriptor
        os.close(fd)
        raise OwnerError(f"the owner lock {path}: {exc.strerror}", exc.errno) from None
    return Owner(fd, directory)


def claim_all(directories: Iterable[Path]) -> tuple[Owner, ...]:
    """Own every directory, or none (those claimed are released) and raise."""
    owners: list[Owner] = []
    try:
        for directory in directories:
            owners.append(claim(directory))
    except BaseException:
        for owned in owners:
            owned.release()
        raise
    return tuple(owners)
