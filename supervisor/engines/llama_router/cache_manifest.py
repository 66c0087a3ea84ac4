"""The GGUF cache's manifest: what the sync copied, and its verdicts on bad source files.

The manifest (<cache>/.lucia-gguf-cache.json, written atomically) records each copied file's
source path, size and mtime_ns and the copy's size, by model name then file name: only what it
records is ever removed. It also remembers each bad source file's verdict, so that an unchanged
bad file is not read again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.library import ggufcheck
from supervisor.protocol.files import FileRefused, read_text, write_atomic

MANIFEST_NAME: Final = ".lucia-gguf-cache.json"
MAX_MANIFEST: Final = 32 * 1024 * 1024


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str
    size: int = Field(ge=0)
    mtime_ns: int
    dest_size: int = Field(ge=0)


class ManifestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    guid: str
    files: dict[str, ManifestFile]


class BadFile(BaseModel):
    """A source file whose header was read and found bad: not read again while unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int = Field(ge=0)
    mtime_ns: int
    reason: str


class Manifest(BaseModel):
    """What the sync copied, by model name then file name; nothing else is ever removed.
    Also the verdicts on bad source files, by source path, so that they are not re-read."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1
    models: dict[str, ManifestModel] = Field(default_factory=dict)
    bad: dict[str, BadFile] = Field(default_factory=dict)


def load_manifest(cache_dir: Path) -> tuple[Manifest, str | None]:
    """The manifest, or an empty one and why when it is absent (None) or unreadable (a line)."""
    path = cache_dir / MANIFEST_NAME
    try:
        manifest = Manifest.model_validate_json(read_text(path, limit=MAX_MANIFEST))
    except FileNotFoundError:
        return Manifest(), None
    except (FileRefused, ValidationError, ValueError) as exc:
        detail = str(exc).splitlines()[0]
        return Manifest(), f"{MANIFEST_NAME} ignored ({detail}); cached files will be copied again"
    # Names come back as paths: keep only entries that are plain names (defence in depth).
    models = {
        name: ManifestModel(
            guid=entry.guid,
            files={f: rec for f, rec in entry.files.items() if _plain(f)},
        )
        for name, entry in manifest.models.items()
        if ggufcheck.name_problem(name) is None
    }
    return Manifest(models=models, bad=manifest.bad), None


def _plain(name: str) -> bool:
    return bool(name) and name not in {".", ".."} and "/" not in name and "\x00" not in name


def save_manifest(
    cache_dir: Path, models: dict[str, ManifestModel], bad: dict[str, BadFile]
) -> None:
    """Write the manifest atomically, its models and verdicts sorted."""
    document = Manifest(models=dict(sorted(models.items())), bad=dict(sorted(bad.items())))
    write_atomic(cache_dir / MANIFEST_NAME, (document.model_dump_json(indent=2) + "\n").encode())
