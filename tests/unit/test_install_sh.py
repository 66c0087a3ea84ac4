"""install.sh's arguments and its refusal of root, which need nothing installed: a usage error
exits 2 with the whole usage, and root is refused before anything is touched. What it installs
and removes is tested as the service user (tests/system/test_systemd.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "install.sh"


def run(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """install.sh with a home of its own and no XDG directories: were a guard to fail, all it
    could touch is under `home`."""
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8"}
    return subprocess.run(
        ["bash", str(INSTALL), *args], capture_output=True, text=True, env=env, check=False
    )


def header_usage() -> list[str]:
    """The header's comment after the shebang, as the usage prints it."""
    lines = INSTALL.read_text().splitlines()[1:]
    comment = lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    return [line[2:] if line.startswith("# ") else line[1:] for line in comment]


def test_the_usage_names_every_form() -> None:
    usage = "\n".join(header_usage())
    for form in ("./install.sh [--enable] [--recipe FILE]", "--uninstall ", "--uninstall --purge"):
        assert form in usage


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--purge"], "--purge removes the data of an uninstall: ./install.sh --uninstall --purge"),
        (["--purge", "--enable"], "--purge removes the data of an uninstall"),
        (["--uninstall", "--enable"], "--uninstall takes no --enable or --recipe"),
        (["--uninstall", "--purge", "--recipe", "x.toml"], "--uninstall takes no --enable"),
        (["--recipe"], ""),
        (["--wipe"], "unknown argument --wipe"),
        (["--help"], ""),
    ],
)
def test_a_usage_error_exits_2_with_the_whole_usage(
    tmp_path: Path, args: list[str], says: str
) -> None:
    result = run(tmp_path, *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout.splitlines() == header_usage()
    assert says in result.stderr
    assert not any(tmp_path.iterdir())


def installed(home: Path) -> list[Path]:
    """What an installation leaves in a home, made by hand: a unit, the venv, the data, the
    state and the settings."""
    share, config = home / ".local/share/lucia", home / ".config"
    paths = [
        config / "systemd/user/lucia-x.service",
        share / "venv/bin/lucia-supervisor",
        share / "README.md",
        share / "host/data/x/status.json",
        home / ".local/state/lucia/x/pursuit.json",
        config / "lucia/gateway.toml",
    ]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("kept\n")
    return paths


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can see that root is refused")
@pytest.mark.parametrize(
    "args", [[], ["--enable"], ["--uninstall"], ["--uninstall", "--purge"]], ids=str
)
def test_root_is_refused_and_nothing_is_touched(tmp_path: Path, args: list[str]) -> None:
    paths = installed(tmp_path)
    result = run(tmp_path, *args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "not as root" in result.stderr
    assert "sudo -iu lucia" in result.stderr  # how to run it as the service user instead
    assert all(path.read_text() == "kept\n" for path in paths)
    assert sorted(p for p in tmp_path.rglob("*") if p.is_file()) == sorted(paths)
