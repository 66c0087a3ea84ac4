"""Files others read: atomic writes, bounded safe reads, and the directory lease."""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Final, Self

MAX_READ: Final = 64 * 1024
FILE_MODE: Final = 0o640
DIR_MODE: Final = 0o750
LEASE_NAME: Final = ".lease"


class FileRefused(OSError):
    """A file that cannot be read safely; str() is one line naming the file and the problem."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class LeaseHeld(RuntimeError):
    """Another process holds the directory lease."""

    def __init__(self, directory: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid else "another process"
        super().__init__(
            f"{directory} is already supervised by {holder}; stop that worker first "
            "(one worker per directory)"
        )
        self.directory = directory
        self.pid = pid


def ensure_dir(path: Path, mode: int = DIR_MODE) -> Path:
    """Create a directory (and parents) with exactly this mode, whatever the umask; an existing
    directory is left as it is (its owner may have chosen otherwise)."""
    if not path.is_dir():
        path.mkdir(mode=mode, parents=True, exist_ok=True)
        os.chmod(path, mode)
    return path


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove temp files that an interrupted write_atomic of path left behind; only the
    process that alone writes path (it holds the lease) may call this."""
    stale = list(path.parent.glob(f".{path.name}.*.tmp"))
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return stale


def write_atomic(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Replace path with data so that a reader sees the old file or the new one, never a mix.

    The temp file lives in the same directory (rename is atomic only within one filesystem); the
    file is fsynced before the rename and the directory after it. On any error the temp file is
    removed and the previous file is left intact.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask must not widen or narrow what we chose
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(mode: int) -> str:
    kinds = {
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISSOCK: "a socket",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def read_text(path: Path, limit: int = MAX_READ) -> str:
    """Read a small UTF-8 file without following symlinks, blocking on FIFOs or reading too much.

    Raises FileNotFoundError when the file is absent and FileRefused for everything else.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise
        if exc.errno == errno.ELOOP:
            raise FileRefused(path, "is a symlink; write the file itself") from None
        raise FileRefused(path, f"cannot be opened: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileRefused(path, f"is {_describe(info.st_mode)}, not a regular file")
        if info.st_size > limit:
            raise FileRefused(path, f"is {info.st_size} bytes; the limit is {limit}")
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileRefused(path, f"grew beyond {limit} bytes while being read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileRefused(path, f"is not valid UTF-8 (byte {exc.start})") from None


class Lease:
    """An exclusive flock on <directory>/.lease, held for the life of a worker.

    The kernel drops the lock when the process dies, however it dies, so a stale lease cannot
    outlive its holder. The holder's pid is written into the file for the error message.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._fd: int | None = None

    def acquire(self) -> Self:
        path = self.directory / LEASE_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            if holder is None:  # the holder may be between its flock and its pid write
                time.sleep(0.05)
                holder = _read_pid(fd)
            os.close(fd)
            raise LeaseHeld(self.directory, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


class FileLock:
    """A short blocking flock around a read-modify-write (the host's generation counter)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1

    def __enter__(self) -> Self:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)
