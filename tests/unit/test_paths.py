"""Directory defaults, each resolved in one place: argument, env, install.sh's, source tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import paths

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("LUCIA_RECIPES_DIR", "LUCIA_DATA_DIR", "LUCIA_STATE_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def test_recipes_without_an_installation_are_the_source_trees() -> None:
    assert paths.recipes_dir() == ROOT / "recipes"
    assert (ROOT / "recipes" / "llama-router.toml").is_file()


def test_recipes_install_sh_installed_win_over_the_source_tree(home: Path) -> None:
    installed = home / "share" / "lucia" / "recipes"
    installed.mkdir(parents=True)
    assert paths.recipes_dir() == installed
    assert paths.recipe_file("x") == installed / "x.toml"


def test_recipes_env_then_argument_win(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (home / "share" / "lucia" / "recipes").mkdir(parents=True)
    monkeypatch.setenv("LUCIA_RECIPES_DIR", str(home / "env"))
    assert paths.recipes_dir() == home / "env"
    assert paths.recipes_dir(str(home / "arg")) == home / "arg"
    assert paths.recipe_file("x", None, str(home / "arg")) == home / "arg" / "x.toml"
    assert paths.recipe_file("x", str(home / "mine.toml"), str(home / "arg")) == home / "mine.toml"


def test_data_dir_and_units_follow_install_sh(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert paths.data_dir() == home / "share" / "lucia" / "host" / "data"
    monkeypatch.setenv("LUCIA_DATA_DIR", str(home / "env-data"))
    assert paths.data_dir() == home / "env-data"
    assert paths.data_dir(str(home / "arg")) == home / "arg"
    assert paths.unit_file("tf") == home / "config" / "systemd" / "user" / "lucia-tf.service"


def test_state_dir(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert paths.state_dir(None, "tf") == home / "home" / ".local" / "state" / "lucia" / "tf"
    monkeypatch.setenv("XDG_STATE_HOME", str(home / "xdg"))
    assert paths.state_dir(None, "tf") == home / "xdg" / "lucia" / "tf"
    monkeypatch.setenv("LUCIA_STATE_DIR", str(home / "env"))
    assert paths.state_dir(None, "tf") == home / "env" / "tf"
    assert paths.state_dir(str(home / "arg"), "tf") == home / "arg"
