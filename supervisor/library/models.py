"""The host's model library: <models>/<guid>/model.json + <guid>/files/, read-only.

model.json is the host's file. We read only the fields below, tolerate every other field, and
publish that subset as schemas/library-model.schema.json. Only Ready models count; everything
else is reported as skipped with one line saying why.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from supervisor.errors import Transient
from supervisor.protocol.files import FileRefused, read_text

MODEL_JSON: Final = "model.json"
FILES_DIR: Final = "files"
GGUF_SUFFIX: Final = ".gguf"
GUID: Final = re.compile(r"[0-9a-fA-F]{32}")

ModelState = Literal["Queued", "Downloading", "Ready", "Failed", "Canceled", "Interrupted"]
MODEL_STATES: Final[tuple[ModelState, ...]] = (
    "Queued",
    "Downloading",
    "Ready",
    "Failed",
    "Canceled",
    "Interrupted",
)


class LibraryFile(BaseModel):
    """One file of a model, as model.json lists it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(
        min_length=1,
        max_length=255,
        pattern=r"^[^/\\\x00-\x1f]+$",
        description="The file's name inside <guid>/files/ (a plain name: no directories, "
        "not '.' or '..'). Only names ending in .gguf are used.",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if value in {".", ".."}:
            raise ValueError(f"{value!r} is not a file name")
        return value


class LibraryModel(BaseModel):
    """The part of <guid>/model.json the worker relies on; every other field is ignored.

    - `state`: one of Queued, Downloading, Ready, Failed, Canceled, Interrupted (exact spelling).
      Only a Ready model is served.
    - `files` (optional): the model's files, each `{"name": "<file name in files/>"}`. When it is
      absent or null, the worker uses every `*.gguf` file directly inside `<guid>/files/`.

    Example: `{"state": "Ready", "files": [{"name": "Qwen3-8B-Q4_K_M.gguf"}]}`.
    """

    model_config = ConfigDict(extra="ignore", frozen=True, title="LibraryModel")

    state: ModelState = Field(description="The download state; only Ready models are served.")
    files: list[LibraryFile] | None = Field(
        default=None,
        description="The model's files in <guid>/files/; absent or null: every *.gguf there.",
    )


def library_schema() -> dict[str, Any]:
    """The JSON Schema of the part of model.json we rely on: schemas/library-model.schema.json."""
    schema = LibraryModel.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = "https://lucia.invalid/schemas/library-model.schema.json"
    return schema


class LibraryUnavailable(Transient):
    """The library directory itself cannot be listed (an unmounted share, a typo)."""


@dataclass(frozen=True)
class ReadyModel:
    """A Ready model and the absolute paths of its .gguf files, sorted by name."""

    guid: str
    directory: Path
    files: tuple[Path, ...]


@dataclass(frozen=True)
class Skipped:
    """A library entry (`<guid>`) or one of its files (`<guid>/files/<name>`) left out, and why."""

    where: str
    reason: str

    def __str__(self) -> str:
        return f"{self.where}: {self.reason}"


@dataclass(frozen=True)
class Library:
    root: Path
    models: tuple[ReadyModel, ...]
    skipped: tuple[Skipped, ...]


def parse_model_json(text: str) -> LibraryModel:
    """Parse model.json; raises ValueError with one line naming the problem."""
    try:
        return LibraryModel.model_validate_json(text)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in err["loc"])
        if err["type"] == "json_invalid":
            detail = err["msg"].removeprefix("Invalid JSON: ")
            raise ValueError(f"not valid JSON: {detail}") from None
        if err["type"] == "missing":
            raise ValueError(f"missing field {where!r}") from None
        given = err.get("input")
        shown = f" (got {given!r})" if isinstance(given, str | int | float | bool) else ""
        raise ValueError(f"{where or 'document'}: {err['msg']}{shown}"[:300]) from None


def scan(models_dir: Path) -> Library:
    """List the Ready models of the library. Only the library directory being unreadable is an
    error (LibraryUnavailable); any problem with one entry skips that entry, with its reason."""
    models_dir = models_dir.absolute()  # file paths are recorded in the cache's manifest
    try:
        entries = sorted(os.scandir(models_dir), key=lambda e: e.name)
    except OSError as exc:
        raise LibraryUnavailable(
            f"model library {models_dir} cannot be read: {exc.strerror}"
        ) from None
    models: list[ReadyModel] = []
    skipped: list[Skipped] = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if not GUID.fullmatch(entry.name):
            skipped.append(Skipped(entry.name, "not a model directory (a 32-hex-digit GUID)"))
            continue
        if not entry.is_dir(follow_symlinks=False):
            skipped.append(Skipped(entry.name, "not a directory"))
            continue
        _scan_model(Path(entry.path), models, skipped)
    return Library(models_dir, tuple(models), tuple(skipped))


def _scan_model(directory: Path, models: list[ReadyModel], skipped: list[Skipped]) -> None:
    guid = directory.name
    try:
        document = parse_model_json(read_text(directory / MODEL_JSON))
    except FileNotFoundError:
        skipped.append(Skipped(guid, f"no {MODEL_JSON}"))
        return
    except FileRefused as exc:
        skipped.append(Skipped(guid, f"{MODEL_JSON} {exc.reason}"))
        return
    except ValueError as exc:
        skipped.append(Skipped(guid, f"{MODEL_JSON}: {exc}"))
        return
    if document.state != "Ready":
        skipped.append(Skipped(guid, f"{document.state}, not Ready"))
        return
    files_dir = directory / FILES_DIR
    try:
        info = files_dir.lstat()
    except OSError as exc:
        skipped.append(Skipped(guid, f"{FILES_DIR}/ cannot be read: {exc.strerror}"))
        return
    if not stat.S_ISDIR(info.st_mode):
        skipped.append(Skipped(guid, f"{FILES_DIR} is not a directory"))
        return
    if document.files is None:
        found = _list_gguf(files_dir, guid, skipped)
    else:
        found = _listed_gguf(files_dir, guid, [f.name for f in document.files], skipped)
    if found is None:
        return
    if not found:
        skipped.append(Skipped(guid, f"Ready but has no .gguf files in {FILES_DIR}/"))
        return
    models.append(ReadyModel(guid, directory, tuple(sorted(found, key=lambda p: p.name))))


def _list_gguf(files_dir: Path, guid: str, skipped: list[Skipped]) -> list[Path] | None:
    try:
        entries = list(os.scandir(files_dir))
    except OSError as exc:
        skipped.append(Skipped(guid, f"{FILES_DIR}/ cannot be listed: {exc.strerror}"))
        return None
    found = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.name.endswith(GGUF_SUFFIX):
            continue
        if entry.is_file(follow_symlinks=False):
            found.append(Path(entry.path))
        else:
            where = f"{guid}/{FILES_DIR}/{entry.name}"
            skipped.append(Skipped(where, "not a regular file (symlinks are not followed)"))
    return found


def _listed_gguf(
    files_dir: Path, guid: str, names: list[str], skipped: list[Skipped]
) -> list[Path]:
    found = []
    for name in dict.fromkeys(names):
        if not name.endswith(GGUF_SUFFIX):
            continue
        path = files_dir / name
        where = f"{guid}/{FILES_DIR}/{name}"
        try:
            info = path.lstat()
        except OSError as exc:
            why = (exc.strerror or "cannot be read").lower()
            skipped.append(Skipped(where, f"listed in {MODEL_JSON} but {why}"))
            continue
        if stat.S_ISREG(info.st_mode):
            found.append(path)
        else:
            skipped.append(Skipped(where, "not a regular file (symlinks are not followed)"))
    return found
