"""Finding and loading recipe files (TOML), each by its kind's schema from the registry."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Final

from pydantic import ValidationError

from supervisor.engines import registry
from supervisor.protocol.files import FileRefused, read_text
from supervisor.recipe.schema import RecipeBase, RecipeError

_MESSAGE: Final = 300  # a recipe error is one line; keys and values in it are clipped


def _clip(text: str, limit: int = 60) -> str:
    escaped = repr(text[:limit])[1:-1]  # control characters and newlines become escapes
    return escaped + ("…" if len(text) > limit else "")


def _format(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False)[:3]:
        where = ".".join(_clip(str(p)) for p in err["loc"])
        what = "unknown key" if err["type"] == "extra_forbidden" else _clip(err["msg"], 200)
        parts.append(f"{where}: {what}" if where else what)
    return "; ".join(parts)


def _nul(value: object, where: str = "") -> str | None:
    """Where a NUL character hides in the data (it cannot be an argument, a path or a value)."""
    if isinstance(value, str):
        return (where or "a value") if "\x00" in value else None
    items: list[tuple[str, object]] = []
    if isinstance(value, dict):
        items = [(str(key), item) for key, item in value.items()]
        if any("\x00" in key for key, _ in items):
            return where or "a key"
    elif isinstance(value, list):
        items = [(str(index), item) for index, item in enumerate(value)]
    for key, item in items:
        found = _nul(item, f"{where}.{key}" if where else key)
        if found:
            return found
    return None


def parse(text: str, origin: str = "<recipe>") -> RecipeBase:
    """A recipe of a registered kind, validated by that kind's schema; raises RecipeError."""
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
        # ValueError: an integer beyond int()'s digit limit; RecursionError: absurd nesting
        detail = _clip(str(exc) or type(exc).__name__, 200)
        raise RecipeError(f"{origin}: not valid TOML: {detail}") from None
    try:
        known = registry.kinds()
    except registry.RegistryError as exc:
        raise RecipeError(f"{origin}: {exc}") from None
    engine = data.get("engine")
    if not isinstance(engine, str) or engine not in known:
        shown = f"'{_clip(engine)}'" if isinstance(engine, str) else "missing"
        raise RecipeError(f"{origin}: engine: must be one of {', '.join(known)} ({shown})")
    try:
        parsed = known[engine].recipe.model_validate(data)
    except ValidationError as exc:  # an unknown key is named as such, NUL in it or not
        raise RecipeError(f"{origin}: {_format(exc)}"[:_MESSAGE]) from None
    where = _nul(data)
    if where:
        raise RecipeError(f"{origin}: {_clip(where)}: contains a NUL character")
    return parsed


def load(path: Path) -> RecipeBase:
    try:
        return parse(read_text(path), str(path))
    except FileNotFoundError:
        raise RecipeError(f"{path}: no such recipe file") from None
    except FileRefused as exc:
        raise RecipeError(str(exc)) from None
