"""A download's model.json: its source, state, progress and inspection, written atomically.

The document is a superset of what supervisor.library.models reads (`state`, and `files` as
plain names inside files/), so a Ready model written here is what the router syncs. The reader
takes plain names only: a GGUF the hub keeps in a sub-folder is hard-linked into files/ when
Ready.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field

from supervisor.library.models import FILES_DIR, GUID, MODEL_JSON, ModelState
from supervisor.protocol.files import FileRefused, ensure_dir, read_text, write_atomic
from supervisor.redaction import redact

SCHEMA_VERSION: Final = 1
MAX_MANIFEST: Final = 4 * 1024 * 1024  # thousands of files with their hashes
COMMIT: Final = re.compile(r"[0-9a-f]{40}")
ACTIVE: Final[frozenset[ModelState]] = frozenset({"Queued", "Downloading"})
RETRYABLE: Final[frozenset[ModelState]] = frozenset({"Failed", "Canceled", "Interrupted"})


class _Doc(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class FileOrigin(_Doc):
    """Where the files come from: the repository, the revision asked for and its commit."""

    repo: str
    revision: str
    commit: str
    include: list[str] = Field(default_factory=list)


class HubFile(_Doc):
    """One file of the download, as the hub's tree lists it for the commit."""

    path: str
    size: int
    sha256: str | None = None  # the LFS id; None for a file kept in git itself
    git_oid: str = Field(alias="gitOid")
    verified: bool = False


class FileName(_Doc):
    name: str


class Inspection(_Doc):
    """What the checks found: the format, architecture, context length and size."""

    format: Literal["gguf", "hf"]
    architecture: str
    context: int | None = None
    size_bytes: int = Field(alias="sizeBytes")
    units: list[str] = Field(default_factory=list)


class ModelManifest(_Doc):
    """<guid>/model.json as this library writes it."""

    schema_version: int = Field(default=SCHEMA_VERSION, alias="schemaVersion")
    id: str
    name: str
    source: FileOrigin
    state: ModelState
    accepted: bool = False  # taken into a running queue (so a restart interrupts it)
    since: str
    message: str = ""
    bytes_done: int = Field(default=0, alias="bytesDone")
    bytes_total: int = Field(default=0, alias="bytesTotal")
    speed: float | None = None  # bytes a second, while downloading
    seconds_left: float | None = Field(default=None, alias="secondsLeft")
    pid: int | None = None  # the hf child's, while downloading
    created: str
    hub_files: list[HubFile] = Field(default_factory=list, alias="hubFiles")
    files: list[FileName] = Field(default_factory=list)
    inspection: Inspection | None = None

    def transition(self, state: ModelState, message: str = "") -> ModelManifest:
        """A copy in state, since now, with message (secrets masked); progress figures end with
        the download."""
        return self.model_copy(
            update={
                "state": state,
                "since": now(),
                "message": redact(message)[:500],
                "speed": None,
                "seconds_left": None,
                "pid": None,
            }
        )


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_guid() -> str:
    return secrets.token_hex(16)


def plain_names(files: list[HubFile]) -> list[FileName]:
    """The files directly inside files/: what supervisor.library.models accepts as `files`."""
    return [FileName(name=f.path) for f in files if "/" not in f.path]


def link_nested(local_dir: Path, files: list[HubFile]) -> list[FileName]:
    """The names the router reads: every top-level file, and each GGUF the hub keeps in a
    sub-folder hard-linked into files/ under its own name (same inode, no space), unless that
    name is taken by another file."""
    names = plain_names(files)
    taken = {n.name for n in names}
    for file in files:
        if "/" not in file.path or not file.path.endswith(".gguf"):
            continue
        name = file.path.rsplit("/", 1)[1]
        link, source = local_dir / name, local_dir / file.path
        if name in taken and not (link.exists() and link.samefile(source)):
            continue
        if not link.exists():
            os.link(source, link, follow_symlinks=False)
        taken.add(name)
        names.append(FileName(name=name))
    return names


def model_dir(root: Path, guid: str) -> Path:
    """<root>/<guid>, refusing anything but a 32-hex GUID (so no path leaves the library)."""
    if not GUID.fullmatch(guid):
        raise ValueError(f"{guid!r} is not a model id (32 hexadecimal digits)")
    return root / guid


def files_dir(root: Path, guid: str) -> Path:
    return model_dir(root, guid) / FILES_DIR


def dump(manifest: ModelManifest) -> bytes:
    document: dict[str, Any] = manifest.model_dump(by_alias=True, mode="json")
    return (json.dumps(document, indent=2) + "\n").encode()


def save(root: Path, manifest: ModelManifest) -> None:
    """Write <guid>/model.json atomically (a reader sees the old state or the new one)."""
    directory = ensure_dir(model_dir(root, manifest.id))
    ensure_dir(directory / FILES_DIR)
    write_atomic(directory / MODEL_JSON, dump(manifest))


def load(root: Path, guid: str) -> ModelManifest:
    """Read <guid>/model.json; FileNotFoundError, or ValueError naming the problem."""
    path = model_dir(root, guid) / MODEL_JSON
    try:
        text = read_text(path, MAX_MANIFEST)
    except FileRefused as exc:
        raise ValueError(str(exc)) from None
    try:
        return ModelManifest.model_validate_json(text)
    except ValueError as exc:
        raise ValueError(
            f"{path}: not a download's model.json ({str(exc).splitlines()[0]})"
        ) from None


def load_all(root: Path) -> list[ModelManifest]:
    """Every download's manifest in the library, oldest first; unreadable ones are left out."""
    found: list[ModelManifest] = []
    try:
        names = sorted(p.name for p in root.iterdir() if GUID.fullmatch(p.name))
    except FileNotFoundError:
        return []
    for guid in names:
        try:
            found.append(load(root, guid))
        except (FileNotFoundError, ValueError):
            continue
    return sorted(found, key=lambda m: (m.created, m.id))


def find(root: Path, key: str) -> ModelManifest:
    """A model by its id, an id's unique prefix, or its name; LookupError saying why not."""
    models = load_all(root)
    exact = [m for m in models if key in (m.id, m.name)]
    if len(exact) == 1:
        return exact[0]
    matches = exact or [m for m in models if len(key) >= 4 and m.id.startswith(key.lower())]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise LookupError(f"no model {key!r} in {root}")
    raise LookupError(f"{key!r} names {len(matches)} models; give the id")
