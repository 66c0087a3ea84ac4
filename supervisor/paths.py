"""Where things live: every directory default resolved in one place, the same for every command.

Each is the argument, then its environment variable, then where install.sh puts it (the XDG
base directories), and, for recipes only, the source tree's recipes/ when nothing is installed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

DATA_ENV: Final = "LUCIA_DATA_DIR"
RECIPES_ENV: Final = "LUCIA_RECIPES_DIR"
STATE_ENV: Final = "LUCIA_STATE_DIR"
SOURCE_RECIPES: Final = Path(__file__).resolve().parent.parent / "recipes"


def _xdg(variable: str, fallback: str) -> Path:
    raw = os.environ.get(variable)
    return Path(raw).expanduser() if raw else Path(fallback).expanduser()


def lucia_share() -> Path:
    """install.sh's share directory: venv, recipes, README and docs, the host's data."""
    return _xdg("XDG_DATA_HOME", "~/.local/share") / "lucia"


def data_dir(value: str | None = None) -> Path:
    """The engines' data directory: the argument, LUCIA_DATA_DIR, then install.sh's."""
    raw = value or os.environ.get(DATA_ENV)
    return (Path(raw).expanduser() if raw else lucia_share() / "host" / "data").absolute()


def keys_file(data: Path) -> Path:
    """The issued inference keys' digests (never the keys): <data>/inference-keys/keys.json."""
    return data / "inference-keys" / "keys.json"


def installed_recipes() -> Path:
    return lucia_share() / "recipes"


def recipes_dir(value: str | None = None) -> Path:
    """The recipes: the argument, LUCIA_RECIPES_DIR, install.sh's copy when it exists, then the
    source tree's recipes/ when that exists; else install.sh's place (so errors name it)."""
    raw = value or os.environ.get(RECIPES_ENV)
    if raw:
        return Path(raw).expanduser().absolute()
    installed = installed_recipes()
    if not installed.is_dir() and SOURCE_RECIPES.is_dir():
        return SOURCE_RECIPES
    return installed.absolute()


def recipe_file(name: str, recipe: str | None = None, recipes: str | None = None) -> Path:
    """An engine's recipe: the file given, else NAME.toml in the recipes directory."""
    if recipe:
        return Path(recipe).expanduser().absolute()
    return recipes_dir(recipes) / f"{name}.toml"


def units_dir() -> Path:
    """Where install.sh writes the user's systemd units."""
    return _xdg("XDG_CONFIG_HOME", "~/.config") / "systemd" / "user"


def unit_file(name: str) -> Path:
    return units_dir() / f"lucia-{name}.service"


def state_dir(value: str | None, name: str) -> Path:
    """A worker's private state: the argument, LUCIA_STATE_DIR/NAME, then XDG's lucia/NAME."""
    if value:
        return Path(value).expanduser().absolute()
    raw = os.environ.get(STATE_ENV)
    if raw:
        return (Path(raw).expanduser() / name).absolute()
    return (_xdg("XDG_STATE_HOME", "~/.local/state") / "lucia" / name).absolute()


MODELS_ENV: Final = "LUCIA_MODELS_DIR"
HF_TOKEN_ENV: Final = "LUCIA_HF_TOKEN_FILE"  # noqa: S105


def models_dir(value: str | None = None) -> Path:
    """The host's model library: the argument, LUCIA_MODELS_DIR, then install.sh's."""
    raw = value or os.environ.get(MODELS_ENV)
    return (Path(raw).expanduser() if raw else lucia_share() / "models").absolute()


def hf_token_file(value: str | None = None) -> Path:
    """The hub token's file: the argument, LUCIA_HF_TOKEN_FILE, then ~/.config/lucia/hf-token."""
    raw = value or os.environ.get(HF_TOKEN_ENV)
    if raw:
        return Path(raw).expanduser().absolute()
    return _xdg("XDG_CONFIG_HOME", "~/.config") / "lucia" / "hf-token"
