"""Block files: owner-only, replaced atomically, read and written with direct I/O where possible.

A block file is `length (8, little endian) | payload | zero padding` to a multiple of ALIGN, so
that O_DIRECT can write and read it from page-aligned buffers and no page cache builds up.
Where the file system refuses O_DIRECT (EINVAL), the same bytes go through the page cache.
A write goes to `.tmp-<name>-<random>` in the same directory, is fsynced, renamed over the
name and the directory fsynced: a reader sees the old file, the new one, or none, never a torn
one. Temp files left by a crash are removed when the tier is opened. A directory fsync that
fails after the rename raises Unsynced: the file is in place, and its bytes are on disk.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import threading
from collections.abc import Callable
from typing import Final, TypeVar

ALIGN: Final = 4096
LENGTH_BYTES: Final = 8
TEMP_PREFIX: Final = ".tmp-"
FILE_MODE: Final = 0o600
Fault = Callable[[str], None]  # called before each step of a write, for fault injection
STEPS: Final = ("open", "write", "half-written", "fsync", "rename", "dirsync")
_DIRECT: Final = getattr(os, "O_DIRECT", 0)
T = TypeVar("T")
_LOCAL = threading.local()  # one aligned buffer per thread, reused: fresh pages cost faults


def _buffer(size: int) -> mmap.mmap:
    """This thread's page-aligned buffer, at least `size` bytes."""
    buffer: mmap.mmap | None = getattr(_LOCAL, "buffer", None)
    if buffer is None or len(buffer) < size:
        if buffer is not None:
            buffer.close()
        buffer = mmap.mmap(-1, size)
        _LOCAL.buffer = buffer
    return buffer


class Missing(Exception):
    """No such block file."""


class Short(Exception):
    """A block file shorter than its length says (truncated), or without a length."""


class Oversize(Exception):
    """A block file larger than any block can be (damaged, or sparse): never read into memory."""


class Unsynced(OSError):
    """The block file is complete and in place under its name, but the directory's fsync
    failed (a crash may lose the name): the caller counts the file as written."""

    def __init__(self, error: OSError, size: int, direct: bool) -> None:
        super().__init__(error.errno, error.strerror)
        self.size = size  # bytes on disk
        self.direct = direct


def disk_size(payload_bytes: int) -> int:
    """The bytes a payload of this size takes on disk."""
    return -(-(LENGTH_BYTES + payload_bytes) // ALIGN) * ALIGN


def _open(path: str, flags: int, direct: bool, dir_fd: int | None) -> tuple[int, bool]:
    if direct and _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, FILE_MODE, dir_fd=dir_fd), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, FILE_MODE, dir_fd=dir_fd), False


def _write_all(fd: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def write(
    dir_fd: int, name: str, payload: bytes | memoryview, direct: bool, fault: Fault | None = None
) -> tuple[int, bool]:
    """Replace `name` in the directory with this payload; returns (bytes on disk, direct I/O
    used). Raises OSError (the temp file is removed) when the disk refuses, Unsynced when
    only the directory's fsync after the rename failed."""
    step = fault if fault is not None else (lambda _step: None)
    size = disk_size(len(payload))
    buffer = _buffer(size)
    end = LENGTH_BYTES + len(payload)
    buffer[:LENGTH_BYTES] = len(payload).to_bytes(LENGTH_BYTES, "little")
    buffer[LENGTH_BYTES:end] = payload
    buffer[end:size] = bytes(size - end)  # zero padding, not an earlier block's bytes
    temp = f"{TEMP_PREFIX}{name}-{secrets.token_hex(6)}"
    step("open")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    fd, used_direct = _open(temp, flags, direct, dir_fd)
    try:
        step("write")
        view = memoryview(buffer)[:size]
        half = (size // 2) // ALIGN * ALIGN
        try:
            _write_all(fd, view[:half])
            step("half-written")
            _write_all(fd, view[half:])
        except OSError as exc:
            if not used_direct or exc.errno != errno.EINVAL:
                raise
            os.close(fd)  # the file system took the open but not the write
            fd = -1
            fd = os.open(temp, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC, dir_fd=dir_fd)
            used_direct = False
            _write_all(fd, view)
        finally:
            view.release()
        step("fsync")
        os.fsync(fd)
    except Exception:
        if fd >= 0:
            os.close(fd)
        os.unlink(temp, dir_fd=dir_fd)
        raise
    os.close(fd)
    try:
        step("rename")
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except Exception:
        os.unlink(temp, dir_fd=dir_fd)
        raise
    try:
        step("dirsync")
        os.fsync(dir_fd)
    except OSError as exc:
        raise Unsynced(exc, size, used_direct) from exc
    return size, used_direct


def read(dir_fd: int, name: str, direct: bool) -> bytes:
    """The payload of a block file (a copy); raises Missing or Short."""
    return read_with(dir_fd, name, direct, bytes)


def read_with(
    dir_fd: int,
    name: str,
    direct: bool,
    use: Callable[[memoryview], T],
    limit: int | None = None,
) -> T:
    """What `use` makes of the payload of a block file, handed to it as a view of this
    thread's read buffer: valid only until `use` returns, so `use` keeps nothing of it
    (no copy is made here). Raises Missing, Short, or Oversize for a file of more than
    `limit` bytes (the buffer is sized from the file's size only below it)."""
    try:
        fd, used_direct = _open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, direct, dir_fd)
    except FileNotFoundError:
        raise Missing(name) from None
    try:
        size = os.fstat(fd).st_size
        if size < LENGTH_BYTES:
            raise Short(f"{name}: {size} bytes")
        if limit is not None and size > limit:
            raise Oversize(f"{name}: {size} bytes, a block file is at most {limit}")
        rounded = -(-size // ALIGN) * ALIGN
        buffer = _buffer(rounded)
        got = _read_into(fd, buffer, rounded, direct=used_direct, name=name, dir_fd=dir_fd)
    finally:
        os.close(fd)
    length = int.from_bytes(buffer[:LENGTH_BYTES], "little")
    if LENGTH_BYTES + length > got:
        raise Short(f"{name}: {got} bytes, its length says {LENGTH_BYTES + length}")
    with memoryview(buffer) as view, view[LENGTH_BYTES : LENGTH_BYTES + length] as payload:
        return use(payload)


def _read_into(
    fd: int, buffer: mmap.mmap, size: int, *, direct: bool, name: str, dir_fd: int
) -> int:
    view = memoryview(buffer)[:size]
    try:
        got = 0
        while got < len(view):
            try:
                count = os.readv(fd, [view[got:]])
            except OSError as exc:
                if not direct or exc.errno != errno.EINVAL:
                    raise
                return _read_buffered(name, dir_fd, view)
            if count == 0:
                break
            got += count
        return got
    finally:
        view.release()


def _read_buffered(name: str, dir_fd: int, view: memoryview) -> int:
    fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        got = 0
        while got < len(view):
            count = os.readv(fd, [view[got:]])
            if count == 0:
                break
            got += count
        return got
    finally:
        os.close(fd)
