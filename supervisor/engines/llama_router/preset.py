"""llama-models.ini: the preset llama-server reads in router mode (`--models-preset FILE`).

The format (llama.cpp tools/server/README.md, "Model presets"; parser in common/preset.cpp):
`version = 1`, an optional `[*]` section whose keys apply to every model, and one section per
model; keys are llama-server arguments without the leading dashes (`ctx-size = 8192`), plus the
preset-only `load-on-startup` (boolean). A section that names no known model needs `model =`
(absolute path recommended). Values run to the end of the line or to a `;`/`#` comment, so no
value may contain those characters. `render` is pure; `write` replaces the file atomically and
only when its content changes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Final, Protocol

from supervisor.protocol.files import FileRefused, read_text, write_atomic

PRESET_NAME: Final = "llama-models.ini"
HEADER: Final = "; written by lucia-supervisor from the model library; edits are overwritten\n"
MAX_PRESET: Final = 4 * 1024 * 1024
_KEY: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_.-]*")  # the parser's `ident`
_BAD_VALUE: Final = re.compile(r"[;#\x00-\x1f\x7f]")
_BAD_SECTION: Final = re.compile(r"[\[\];#\x00-\x1f\x7f]")
# Keys the worker sets per model; a default for them would load or point every model wrongly.
RESERVED: Final = frozenset({"model", "m", "mmproj", "load-on-startup", "version"})

Value = str | int | float | bool


class PresetError(ValueError):
    """A preset that cannot be written as asked; str() is one line."""


class StartupRefused(PresetError):
    """The load-on-startup list cannot be honoured; nothing should be started."""


class TooManyStartupModels(StartupRefused):
    pass


class StartupModelsMissing(StartupRefused):
    def __init__(self, missing: Sequence[str]) -> None:
        self.missing = tuple(missing)
        names = ", ".join(self.missing)
        super().__init__(f"load-on-startup models not in the cache (not Ready or skipped): {names}")


class PresetModel(Protocol):
    """What a preset section needs; paths are relative to the cache directory."""

    @property
    def name(self) -> str: ...

    @property
    def model_file(self) -> str: ...

    @property
    def mmproj_file(self) -> str | None: ...


def format_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if not text or text != text.strip() or _BAD_VALUE.search(text):
        raise PresetError(
            f"preset value {text!r} is empty, has outer spaces, or contains ; # or a control "
            "character"
        )
    return text


def _container_path(container_dir: PurePosixPath, relative: str) -> str:
    path = container_dir / relative
    if ".." in PurePosixPath(relative).parts or PurePosixPath(relative).is_absolute():
        raise PresetError(f"cache path {relative!r} leaves the cache directory")
    return format_value(str(path))


def render(
    models: Iterable[PresetModel],
    defaults: Mapping[str, Value],
    load_on_startup: Iterable[str],
    container_cache_dir: str,
    contexts: Mapping[str, int] | None = None,
    *,
    embeddings: Iterable[str] = (),
) -> str:
    """The preset text: deterministic (sections and keys sorted), ending in one newline.
    contexts: a model's planned ctx-size (the memory plan's "auto"), set in its section;
    embeddings: the embedding models (their GGUF declares a pooling type), whose sections get
    `embeddings = true`: llama-server answers /v1/embeddings only with it (serves.py)."""
    container_dir = PurePosixPath(container_cache_dir)
    if not container_dir.is_absolute():
        raise PresetError(f"container cache directory {container_cache_dir!r} is not absolute")
    startup, embedding = set(load_on_startup), set(embeddings)
    lines = [HEADER.rstrip("\n"), "version = 1"]
    if defaults:
        lines += ["", "[*]"]
        for key in sorted(defaults):
            if not _KEY.fullmatch(key):
                raise PresetError(f"preset key {key!r} is not an argument name (like ctx-size)")
            if key in RESERVED:
                raise PresetError(f"preset key {key!r} is set per model by the worker")
            lines.append(f"{key} = {format_value(defaults[key])}")
    seen: set[str] = set()
    for model in sorted(models, key=lambda m: m.name):
        if model.name in seen:
            raise PresetError(f"two models are named {model.name!r}")
        seen.add(model.name)
        if not model.name or model.name != model.name.strip() or _BAD_SECTION.search(model.name):
            raise PresetError(f"model name {model.name!r} cannot be a preset section")
        lines += ["", f"[{model.name}]"]
        lines.append(f"model = {_container_path(container_dir, model.model_file)}")
        if model.mmproj_file is not None:
            lines.append(f"mmproj = {_container_path(container_dir, model.mmproj_file)}")
        if contexts and model.name in contexts:
            lines.append(f"ctx-size = {contexts[model.name]}")
        if model.name in embedding:
            lines.append("embeddings = true")
        if model.name in startup:
            lines.append("load-on-startup = true")
    return "\n".join(lines) + "\n"


def models(text: str | None) -> tuple[str, ...]:
    """Pure: the model names a preset serves, its sections but `[*]`, in order; none without
    a preset."""
    names: list[str] = []
    for raw in (text or "").splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]") and line not in ("[*]", "[]"):
            names.append(line[1:-1])
    return tuple(dict.fromkeys(names))


def changed_sections(before: str | None, after: str) -> tuple[str, ...]:
    """The model sections of `after` that differ from `before` (all of them when the global
    `[*]` section or the rest of the header changed): those a reloading router unloads."""

    def split(text: str) -> dict[str, str]:
        found: dict[str, str] = {}
        name = ""
        for line in filter(None, text.splitlines()):
            if line.startswith("[") and line.endswith("]"):
                name = line[1:-1]
            found[name] = found.get(name, "") + line + "\n"
        return found

    old, new = split(before or ""), split(after)
    shared = old.get("") == new.get("") and old.get("*") == new.get("*")
    return tuple(
        name for name in new if name not in ("", "*") and (not shared or old.get(name) != new[name])
    )


def write(path: Path, text: str) -> bool:
    """Write the preset atomically unless it already holds exactly text; whether it wrote."""
    try:
        if read_text(path, limit=MAX_PRESET) == text:
            return False
    except (FileNotFoundError, FileRefused):
        pass  # absent, a symlink, not a regular file, too big: replace it
    write_atomic(path, text.encode(), mode=0o644)
    return True


def check_startup(
    load_on_startup: Sequence[str], available: Iterable[str], models_max: int
) -> None:
    """Refuse a start whose load-on-startup list cannot be honoured, before anything starts.

    Raises TooManyStartupModels when more models would load at start than --models-max allows,
    and StartupModelsMissing (with .missing) naming those not in the cache.
    """
    wanted = list(dict.fromkeys(load_on_startup))
    if len(wanted) > models_max:
        raise TooManyStartupModels(
            f"{len(wanted)} load-on-startup models ({', '.join(wanted)}) but --models-max is "
            f"{models_max}; raise models_max or load fewer at start"
        )
    have = set(available)
    missing = [name for name in wanted if name not in have]
    if missing:
        raise StartupModelsMissing(missing)
