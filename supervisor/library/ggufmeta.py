"""A GGUF file's metadata: the key-value pairs of its header, read without reading the file.

The layout (GGUF versions 2 and 3, little-endian; the `gguf` package's constants.py and
llama.cpp's ggml/src/gguf.cpp): magic `GGUF`, uint32 version, uint64 tensor count, uint64 KV
count, then each KV pair: a string key (uint64 length + UTF-8 bytes), a uint32 value type and
the value. Strings are length-prefixed; an array is a uint32 element type, a uint64 count and
the elements. Tensor infos and tensor data follow the KV pairs and are never read here.

Reading is bounded: at most MAX_HEADER bytes, in chunks of 64 KiB doubling up to CHUNK (so a
read overshoots the header by at most about 2x), through a descriptor that refuses symlinks and
non-regular files (ggufcheck.open_regular). Only what planning needs is kept: scalars, and
numeric arrays up to MAX_KEPT_ARRAY elements (the per-layer arrays); string arrays (the
vocabulary) and long arrays are stepped over, not stored.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor.library.ggufcheck import MAGIC, Unreadable, header_problem, open_regular

FIRST_CHUNK: Final = 64 * 1024  # most of a header without a vocabulary, little tensor data
CHUNK: Final = 4 * 1024 * 1024
MAX_HEADER: Final = 512 * 1024 * 1024  # a 256k-token vocabulary with merges is ~30 MB
MAX_KV: Final = 1_000_000
MAX_KEY: Final = 65_535
MAX_KEPT_ARRAY: Final = 4096

Scalar = int | float | bool | str
Value = Scalar | tuple[int | float | bool, ...]

# value type -> struct format of one element (types 8 string and 9 array are variable)
_FIXED: Final[dict[int, str]] = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_U64: Final = struct.Struct("<Q")
_STRING: Final = 8
_ARRAY: Final = 9


class BadHeader(ValueError):
    """A GGUF header that cannot be parsed; str() names the file and the problem."""


@dataclass(frozen=True)
class Metadata:
    """The kept key-value pairs of one GGUF file, and the file's size in bytes."""

    path: Path
    size: int
    version: int
    tensor_count: int
    values: dict[str, Value]

    @property
    def architecture(self) -> str:
        arch = self.values.get("general.architecture")
        return arch if isinstance(arch, str) else ""

    def get(self, key: str) -> Value | None:
        return self.values.get(key)

    def arch_key(self, suffix: str) -> Value | None:
        """`<architecture>.<suffix>`, e.g. arch_key("block_count")."""
        return self.values.get(f"{self.architecture}.{suffix}")


class _Reader:
    """Sequential reads through pread, buffered, with a hard bound on the bytes consumed."""

    def __init__(self, fd: int, size: int, path: Path) -> None:
        self._fd, self._size, self._path = fd, size, path
        self._buffer = b""
        self._start = 0  # file offset of _buffer[0]
        self._pos = 0  # offset inside _buffer
        self._reads = 0

    @property
    def offset(self) -> int:
        return self._start + self._pos

    def _fail(self, what: str) -> BadHeader:
        return BadHeader(f"{self._path}: {what} (at byte {self.offset})")

    def take(self, count: int) -> bytes:
        if self.offset + count > min(self._size, MAX_HEADER):
            if self.offset + count > self._size:
                raise self._fail("truncated GGUF header")
            raise self._fail(f"GGUF header longer than {MAX_HEADER} bytes")
        if self._pos + count > len(self._buffer):
            self._start += self._pos
            rest = self._buffer[self._pos :]
            # 64 KiB first, doubling to CHUNK: a read overshoots a header by at most about 2x
            want = max(min(CHUNK, FIRST_CHUNK << self._reads), count) - len(rest)
            self._buffer = rest + os.pread(self._fd, want, self._start + len(rest))
            self._reads += 1
            self._pos = 0
            if count > len(self._buffer):
                raise self._fail("truncated GGUF header (the file shrank)")
        data = self._buffer[self._pos : self._pos + count]
        self._pos += count
        return data

    def skip(self, count: int) -> None:
        """Step over count bytes without reading them when they are not buffered."""
        if self._pos + count <= len(self._buffer):
            self._pos += count
            return
        target = self.offset + count
        if target > min(self._size, MAX_HEADER):
            raise self._fail("truncated GGUF header" if target > self._size else "header too long")
        self._start, self._buffer, self._pos = target, b"", 0

    def unpack(self, fmt: str) -> int | float | bool:
        value: int | float | bool = struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]
        return value

    def count(self, limit: int, what: str) -> int:
        value = int(self.unpack("<Q"))
        if value > limit:
            raise self._fail(f"{what} {value} is more than {limit}")
        return value

    def string(self, limit: int = MAX_HEADER) -> str:
        raw = self.take(self.count(limit, "string length"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self._fail("a string is not valid UTF-8") from None

    def skip_strings(self, count: int) -> None:
        """Step over count length-prefixed strings (a vocabulary): the hot loop of a header."""
        unpack = _U64.unpack_from
        while count:
            self.take(0)  # keep offsets honest before touching the buffer directly
            buffer, pos, end = self._buffer, self._pos, len(self._buffer) - 8
            while count and pos <= end:
                (length,) = unpack(buffer, pos)
                if pos + 8 + length > len(buffer):
                    break
                pos += 8 + length
                count -= 1
            self._pos = pos
            if count:  # the next string straddles the buffer's end: read it the slow way
                self.skip(self.count(MAX_HEADER, "string length"))
                count -= 1


def _value(reader: _Reader, kind: int) -> Value | None:
    """One value of type kind; None for an array that is stepped over."""
    if kind in _FIXED:
        return reader.unpack(_FIXED[kind])
    if kind == _STRING:
        return reader.string()
    if kind != _ARRAY:
        raise reader._fail(f"unknown GGUF value type {kind}")
    element = int(reader.unpack("<I"))
    count = reader.count(MAX_HEADER, "array length")
    if element in _FIXED:
        fmt = _FIXED[element]
        width = struct.calcsize(fmt)
        if count > MAX_KEPT_ARRAY:
            reader.skip(count * width)
            return None
        raw = reader.take(count * width)
        return tuple(struct.unpack(f"<{count}{fmt[1]}", raw))
    if element == _STRING:
        reader.skip_strings(count)
        return None
    raise reader._fail(f"unsupported GGUF array element type {element}")


def read_metadata(path: Path) -> Metadata:
    """The header's KV pairs of one GGUF file. Raises BadHeader or ggufcheck.Unreadable."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        reader = _Reader(fd, size, path)
        head = os.pread(fd, 8, 0)
        problem = header_problem(head)
        if problem is not None:
            raise BadHeader(f"{path}: {problem}")
        reader.skip(len(MAGIC))
        version = int(reader.unpack("<I"))
        tensor_count = int(reader.unpack("<Q"))
        kv_count = reader.count(MAX_KV, "KV count")
        values: dict[str, Value] = {}
        for _ in range(kv_count):
            key = reader.string(MAX_KEY)
            value = _value(reader, int(reader.unpack("<I")))
            if value is not None:
                values[key] = value
        return Metadata(path, size, version, tensor_count, values)
    except OSError as exc:
        raise Unreadable(f"cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)
