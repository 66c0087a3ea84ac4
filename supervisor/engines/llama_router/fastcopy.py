"""An atomic fast copy of one file: absent or complete, never partial, by the kernel's fast paths.

A copy goes to a temp name in the destination directory, is fsync'd, renamed, and the directory
fsync'd. It uses copy_file_range, then sendfile, then pread/pwrite, falling back when a method
does not work for the files, in chunks so that progress is reported and a cancel is noticed
between chunks.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from supervisor.errors import Cancelled
from supervisor.protocol.files import fsync_dir

CHUNK_SIZE: Final = 64 * 1024 * 1024
BUFFER_SIZE: Final = 1024 * 1024  # the pread/pwrite fallback's buffer
CACHE_FILE_MODE: Final = 0o644  # the container may read as any uid; models are not secrets
_PARTIAL: Final = re.compile(r"\..+\.[0-9a-f]{8}\.partial")

Method = Literal["copy_file_range", "sendfile", "pread"]
_METHODS: Final[tuple[Method, ...]] = ("copy_file_range", "sendfile", "pread")
# errnos that mean "this way of copying does not work for these files", not "the copy failed"
_UNSUPPORTED: Final = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF, errno.EPERM}
)


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


def remove_partials_in(directory: Path) -> None:
    """Remove the temp files interrupted copies left in directory (only names copy_file makes)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if _PARTIAL.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)
