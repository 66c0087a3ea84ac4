"""After a download, before Ready: each file against the hub's ids, then its format's checks.

Every file's SHA-256 against its LFS id (a file kept in git itself: its git blob id); every GGUF
through the project's header checks (supervisor.library.ggufcheck, ggufmeta), its architecture,
context length and size into the inspection; an HF-layout model (config.json, safetensors and a
tokenizer, as the vLLM engine mounts it) through the checks that fit it. A failure names the file
and the check.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Final

from supervisor.host.models.manifest import HubFile, Inspection
from supervisor.library import ggufcheck
from supervisor.library.ggufmeta import BadHeader, read_metadata

CHUNK: Final = 8 * 1024 * 1024
MAX_SAFETENSORS_HEADER: Final = 100 * 1024 * 1024
MAX_JSON: Final = 64 * 1024 * 1024
TOKENIZERS: Final = ("tokenizer.json", "tokenizer.model")


class CheckFailed(Exception):
    """A file failed a check; str() names the file and the check."""


def digest(path: Path, file: HubFile) -> str:
    """The hex digest the hub's id for file is of: sha256, or the git blob sha1."""
    fd = ggufcheck.open_regular(path)
    try:
        if file.sha256 is not None:
            hasher = hashlib.sha256()
        else:
            hasher = hashlib.sha1(usedforsecurity=False)
            hasher.update(b"blob %d\0" % os.fstat(fd).st_size)
        while chunk := os.read(fd, CHUNK):
            hasher.update(chunk)
        return hasher.hexdigest()
    finally:
        os.close(fd)


def check_file(local_dir: Path, file: HubFile) -> None:
    """Size and hash of one downloaded file against the hub's tree; CheckFailed when wrong."""
    path = local_dir / file.path
    try:
        size = path.lstat().st_size
        if size != file.size:
            raise CheckFailed(
                f"{file.path}: size check failed: {size} bytes, the hub says {file.size}"
            )
        got = digest(path, file)
    except FileNotFoundError:
        raise CheckFailed(f"{file.path}: missing after the download") from None
    except ggufcheck.Unreadable as exc:
        raise CheckFailed(f"{file.path}: {exc.reason}") from None
    want = file.sha256 or file.git_oid
    if got != want:
        kind = (
            "SHA-256 check failed against the hub's LFS id"
            if file.sha256
            else ("git blob id check failed")
        )
        raise CheckFailed(f"{file.path}: {kind} (expected {want}, got {got})")


def verify_files(
    local_dir: Path, files: list[HubFile], done: Callable[[HubFile], None] | None = None
) -> None:
    """Check every file not yet verified; done(file) after each one that passes."""
    for file in files:
        if file.verified:
            continue
        check_file(local_dir, file)
        if done is not None:
            done(file)


def inspect(local_dir: Path, files: list[HubFile]) -> Inspection:
    """The format's checks and the inspection: GGUF when there are .gguf files, else HF layout."""
    ggufs = [local_dir / f.path for f in files if f.path.endswith(ggufcheck.SUFFIX)]
    if ggufs:
        return inspect_gguf(ggufs)
    if any(f.path == "config.json" for f in files):
        return inspect_hf(local_dir, files)
    raise CheckFailed("neither a .gguf file nor an HF-layout model (config.json) was downloaded")


def inspect_gguf(paths: list[Path]) -> Inspection:
    """Every GGUF's header (all of its key-value pairs, no tensor data); the models' grouping."""
    architecture, context, size = "", None, 0
    for path in sorted(paths):
        try:
            meta = read_metadata(path)
        except BadHeader as exc:
            raise CheckFailed(
                f"{path.name}: GGUF header check failed: {str(exc).removeprefix(f'{path}: ')}"
            ) from None
        except ggufcheck.Unreadable as exc:
            raise CheckFailed(f"{path.name}: {exc.reason}") from None
        size += meta.size
        if ggufcheck.is_mmproj(path.name) or architecture:
            continue
        architecture = meta.architecture
        found = meta.arch_key("context_length")
        context = int(found) if isinstance(found, int) else None
    grouping = ggufcheck.group(paths)
    if grouping.rejected:
        raise CheckFailed(f"GGUF file check failed: {grouping.rejected[0]}")
    if not architecture:
        raise CheckFailed(f"{paths[0].name}: GGUF header check failed: no general.architecture")
    units = sorted(unit.name for unit in grouping.units)
    return Inspection(
        format="gguf", architecture=architecture, context=context, sizeBytes=size, units=units
    )


def _json_object(path: Path, name: str) -> dict[str, object]:
    try:
        if path.stat().st_size > MAX_JSON:
            raise CheckFailed(f"{name}: JSON check failed: larger than {MAX_JSON} bytes")
        value = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckFailed(f"{name}: JSON check failed: {exc}") from None
    if not isinstance(value, dict):
        raise CheckFailed(f"{name}: JSON check failed: not an object")
    return value


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file's header is unusable (length, JSON, offsets), or None."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "shorter than its 8-byte header length"
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_SAFETENSORS_HEADER, size - 8):
            return f"header length {length} does not fit the file ({size} bytes)"
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return "header is not JSON"
    if not isinstance(header, dict):
        return "header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            return f"tensor {name!r} has no data_offsets"
        end = max(end, int(offsets[1]))
    if 8 + length + end > size:
        return f"tensors end at byte {8 + length + end}, the file has {size}"
    return None


def inspect_hf(local_dir: Path, files: list[HubFile]) -> Inspection:
    """config.json, every safetensors header and a tokenizer, as vLLM needs them."""
    config = _json_object(local_dir / "config.json", "config.json")
    names = {f.path for f in files}
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    if not weights:
        raise CheckFailed("config.json: HF layout check failed: no .safetensors weights")
    for name in weights:
        problem = safetensors_problem(local_dir / name)
        if problem:
            raise CheckFailed(f"{name}: safetensors header check failed: {problem}")
    tokenizer = next((t for t in TOKENIZERS if t in names), None)
    if tokenizer is None:
        raise CheckFailed("HF layout check failed: no tokenizer.json or tokenizer.model")
    if tokenizer.endswith(".json"):
        _json_object(local_dir / tokenizer, tokenizer)
    architectures = config.get("architectures")
    architecture = (
        str(architectures[0])
        if isinstance(architectures, list) and architectures
        else str(config.get("model_type", ""))
    )
    if not architecture:
        raise CheckFailed("config.json: HF layout check failed: no architectures or model_type")
    context = config.get("max_position_embeddings")
    return Inspection(
        format="hf",
        architecture=architecture,
        context=context if isinstance(context, int) else None,
        sizeBytes=sum(f.size for f in files),
    )


def reinspect(local_dir: Path, files: list[HubFile]) -> str | None:
    """At startup: why a Ready GGUF model no longer passes (headers only, no hashing), or None."""
    ggufs = [f for f in files if f.path.endswith(ggufcheck.SUFFIX)]
    for file in ggufs:
        path = local_dir / file.path
        try:
            size = path.lstat().st_size
        except FileNotFoundError:
            return f"{file.path}: missing"
        if size != file.size:
            return f"{file.path}: size check failed: {size} bytes, the hub says {file.size}"
    try:
        if ggufs:
            inspect_gguf([local_dir / f.path for f in ggufs])
    except CheckFailed as exc:
        return str(exc)
    return None
