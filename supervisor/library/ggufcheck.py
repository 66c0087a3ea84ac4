"""GGUF files, checked without reading them whole: the 8-byte header and the file names.

A model's files are grouped into units: one unit per model the router can serve, named by its
file name without `.gguf`, or by the prefix before `-00001-of-0000N.gguf` for a split model (all
N shards must be present). A file whose name contains "mmproj" is a multimodal projector and
goes with the model's unit(s). A file that cannot be used is rejected and named, with its reason.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import struct
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

MAGIC: Final = b"GGUF"
VERSIONS: Final = (2, 3)
HEADER_SIZE: Final = 8  # magic + little-endian uint32 version
SUFFIX: Final = ".gguf"
SPLIT: Final = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# A unit's name becomes a directory name and an INI section ([name]) whose paths are INI values:
# no path separators, no brackets, no INI comment characters, no control characters.
_UNSAFE: Final = re.compile(r"[/\\\[\];#\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Rejected:
    """A file that is skipped and never copied, and why."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path.name}: {self.reason}"


@dataclass(frozen=True)
class Unit:
    """One servable model: its shards in order (one for a single-file model) and its mmproj."""

    name: str
    shards: tuple[Path, ...]
    mmproj: Path | None = None

    @property
    def main(self) -> Path:
        """The file llama-server is given: the single file, or shard 00001."""
        return self.shards[0]

    @property
    def files(self) -> tuple[Path, ...]:
        return self.shards + ((self.mmproj,) if self.mmproj else ())


@dataclass(frozen=True)
class Grouping:
    units: tuple[Unit, ...]
    rejected: tuple[Rejected, ...]


def header_problem(head: bytes) -> str | None:
    """Why these first bytes are not a usable GGUF header, or None when they are."""
    if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
        return "not a GGUF file (does not start with GGUF)"
    if len(head) < HEADER_SIZE:
        return f"truncated GGUF header ({len(head)} bytes)"
    (version,) = struct.unpack_from("<I", head, len(MAGIC))
    if version not in VERSIONS:
        return f"GGUF version {version} (only versions 2 and 3 are supported)"
    return None


class Unreadable(Exception):
    """The header could not be read at all (as opposed to read and found bad)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def open_regular(path: Path) -> int:
    """A read-only descriptor of path, a regular file reached without following a symlink.

    Raises Unreadable with a one-line reason; the caller closes the descriptor."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unreadable("is a symlink") from None
        raise Unreadable(f"cannot be opened: {exc.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unreadable("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(path: Path) -> bytes:
    """The first 8 bytes of path (fewer if it is shorter); never more, never through a symlink.

    Raises Unreadable with a one-line reason."""
    fd = open_regular(path)
    try:
        return os.pread(fd, HEADER_SIZE, 0)
    except OSError as exc:
        raise Unreadable(f"cannot be read: {exc.strerror}") from None
    finally:
        os.close(fd)


def check_header(path: Path) -> str | None:
    """Why path is not a usable GGUF file, judged by its first 8 bytes, or None."""
    try:
        return header_problem(read_header(path))
    except Unreadable as exc:
        return exc.reason


def is_mmproj(name: str) -> bool:
    return "mmproj" in name.lower()


def split_part(name: str) -> tuple[str, int, int] | None:
    """(prefix, shard number, shard count) for a split-model file name, else None."""
    match = SPLIT.search(name)
    if not match:
        return None
    return name[: match.start()], int(match[1]), int(match[2])


def unit_name(name: str) -> str:
    """The model name a (non-mmproj) file belongs to."""
    split = split_part(name)
    if split:
        return split[0]
    return name.removesuffix(SUFFIX)


def name_problem(name: str) -> str | None:
    """Why a model name cannot be a cache directory and a preset section, or None. Looser than
    the served-name rule (protocol.names), which the library's add holds new downloads to: a
    name from a library before that rule is served still."""
    if not name:
        return "gives an empty model name"
    if name.startswith((".", " ")) or name.endswith(" "):
        return f"model name {name!r} starts with a dot or a space, or ends with a space"
    if _UNSAFE.search(name):
        return f"model name {name!r} contains / \\ [ ] ; # or a control character"
    return None


def group(paths: Iterable[Path]) -> Grouping:
    """Group one library model's .gguf files into units, by name only (reads nothing).

    Split shards must agree on N and all of 1..N must be present, else every shard of that
    model is rejected (a missing shard is named by the name it should have). The first mmproj
    file (by name) goes with every unit of the model; other mmproj files are rejected.
    """
    rejected: list[Rejected] = []
    singles: dict[str, Path] = {}
    splits: dict[str, list[tuple[int, int, Path]]] = defaultdict(list)
    mmprojs: list[Path] = []
    for path in sorted(set(paths), key=lambda p: p.name):
        name = path.name
        if not name.endswith(SUFFIX):
            rejected.append(Rejected(path, "not a .gguf file"))
        elif is_mmproj(name):
            if (problem := name_problem(name)) is not None:
                rejected.append(Rejected(path, problem.replace("model name", "file name", 1)))
            else:
                mmprojs.append(path)
        elif (split := split_part(name)) is not None:
            prefix, index, count = split
            splits[prefix].append((index, count, path))
        else:
            singles[name.removesuffix(SUFFIX)] = path

    candidates: dict[str, list[Unit]] = defaultdict(list)
    for name, path in singles.items():
        candidates[name].append(Unit(name, (path,)))
    for prefix, parts in splits.items():
        unit = _split_unit(prefix, parts, rejected)
        if unit is not None:
            candidates[prefix].append(unit)

    units = _resolve(candidates, rejected)
    mmproj = _pick_mmproj(mmprojs, bool(units), rejected)
    return Grouping(
        tuple(Unit(u.name, u.shards, mmproj) for u in units),
        tuple(sorted(rejected, key=lambda r: r.path.name)),
    )


def _resolve(candidates: dict[str, list[Unit]], rejected: list[Rejected]) -> list[Unit]:
    """One unit per usable name: a name that is unsafe or taken twice rejects its files."""
    units = []
    for name, found in sorted(candidates.items()):
        problem = name_problem(name)
        if problem is None and len(found) > 1:
            problem = f"both a single file and a split model are named {name}"
        if problem is not None:
            rejected.extend(Rejected(path, problem) for unit in found for path in unit.shards)
        else:
            units.append(found[0])
    return units


def _pick_mmproj(mmprojs: list[Path], has_units: bool, rejected: list[Rejected]) -> Path | None:
    if not mmprojs:
        return None
    if not has_units:
        rejected.extend(Rejected(path, "an mmproj file without a model") for path in mmprojs)
        return None
    chosen = mmprojs[0]
    reason = f"another mmproj file ({chosen.name}) is used"
    rejected.extend(Rejected(extra, reason) for extra in mmprojs[1:])
    return chosen


def _split_unit(
    prefix: str, parts: list[tuple[int, int, Path]], rejected: list[Rejected]
) -> Unit | None:
    counts = sorted({count for _, count, _ in parts})
    if len(counts) > 1:
        shown = ", ".join(f"of-{count:05d}" for count in counts)
        reason = f"split model {prefix} mixes shard counts ({shown}) and is skipped"
        rejected.extend(Rejected(path, reason) for _, _, path in parts)
        return None
    count = counts[0]
    by_index: dict[int, Path] = {}
    for index, _, path in parts:
        if 1 <= index <= count:
            by_index[index] = path
        else:
            rejected.append(Rejected(path, f"shard number {index} is not in 1..{count}"))
    missing = [index for index in range(1, count + 1) if index not in by_index]
    if not missing:
        return Unit(prefix, tuple(by_index[index] for index in range(1, count + 1)))
    directory = parts[0][2].parent
    for index in missing:
        shard = directory / f"{prefix}-{index:05d}-of-{count:05d}{SUFFIX}"
        rejected.append(Rejected(shard, f"shard missing (split model {prefix} skipped)"))
    return None
