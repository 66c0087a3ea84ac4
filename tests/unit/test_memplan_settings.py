"""The machine settings file: place, defaults, profiles, the voice floor, one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.memplan.settings import (
    GIB,
    MachineError,
    MachineReserves,
    load,
    machine_file,
    parse,
)

G = GIB


@pytest.mark.parametrize(
    ("text", "limit", "profile", "reserves", "multiplier"),
    [
        ("", "unified", "workstation", (4, 3, 8, 3), 2.0),
        ('profile = "production"', "unified", "production", (8, 8, 8, 8), 2.0),
        ('limit = "gpu"', "gpu", "gpu-server", (0, 0, 0, 2), 2.0),
        ('limit = "gpu"\nprofile = "workstation"', "gpu", "workstation", (4, 3, 8, 3), 2.0),
        ("limit = 121.7", round(121.7 * G), "workstation", (4, 3, 8, 3), 2.0),
        ("limit = 64", 64 * G, "workstation", (4, 3, 8, 3), 2.0),
        ("weight_multiplier = 1.5", "unified", "workstation", (4, 3, 8, 3), 1.5),
        ("[reserves]\nos = 6\nvoice = 12", "unified", "workstation", (6, 3, 12, 3), 2.0),
        ('limit = "gpu"\n[reserves]\nvoice = 1', "gpu", "gpu-server", (0, 0, 1, 2), 2.0),
        (
            'profile = "production"\n[reserves]\nruntime = 0.5',
            "unified",
            "production",
            (8, 8, 8, 0.5),
            2.0,
        ),
    ],
)
def test_settings(
    text: str,
    limit: object,
    profile: str,
    reserves: tuple[float, float, float, float],
    multiplier: float,
) -> None:
    settings = parse(text, "/etc/m.toml")
    assert settings.limit == limit
    assert settings.profile == profile
    assert settings.reserves == MachineReserves(*(round(value * G) for value in reserves))
    assert settings.weight_multiplier == multiplier
    assert settings.source == Path("/etc/m.toml")


def test_reserve_total() -> None:
    assert parse("").reserves.total == 18 * G
    assert parse('profile = "production"').reserves.total == 32 * G


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[reserves]\nvoice = 6", "/m.toml: reserves.voice: 6 GiB is below the voice floor of 8"),
        ('profile = "production"\n[reserves]\nvoice = 4', "below the voice floor"),
        ("limit = 0", "/m.toml: limit"),
        ("limit = -5", "/m.toml: limit"),
        ('limit = "host"', "/m.toml: limit"),
        ('limit = "64"', "/m.toml: limit"),  # strict: a string is not a number
        ("weight_multiplier = 0.5", "/m.toml: weight_multiplier"),
        ("weight_multiplier = 11", "/m.toml: weight_multiplier"),
        ('profile = "laptop"', "/m.toml: profile"),
        ("color = 1", "/m.toml: color: unknown key"),
        ("[reserves]\nswap = 1", "/m.toml: reserves.swap: unknown key"),
        ("[reserves]\nos = -1", "/m.toml: reserves.os"),
        ('[reserves]\nos = "4"', "/m.toml: reserves.os"),
        ("limit = nan", "/m.toml: limit"),
        ("limit = = 3", "/m.toml: not valid TOML"),
    ],
)
def test_refused(text: str, error: str) -> None:
    with pytest.raises(MachineError) as caught:
        parse(text, "/m.toml")
    message = str(caught.value)
    assert error in message
    assert "\n" not in message


def test_place(tmp_path: Path) -> None:
    assert machine_file({"LUCIA_MACHINE_FILE": str(tmp_path / "x.toml")}) == (
        tmp_path / "x.toml",
        True,
    )
    assert machine_file({"XDG_CONFIG_HOME": str(tmp_path)}) == (
        tmp_path / "lucia/machine.toml",
        False,
    )
    assert machine_file({})[0] == Path("~/.config/lucia/machine.toml").expanduser()


def test_load_defaults_when_absent_and_errors_when_named(tmp_path: Path) -> None:
    assert load(environ={"XDG_CONFIG_HOME": str(tmp_path)}).source is None
    with pytest.raises(MachineError, match="no such machine settings file"):
        load(environ={"LUCIA_MACHINE_FILE": str(tmp_path / "missing.toml")})
    (tmp_path / "lucia").mkdir()
    (tmp_path / "lucia/machine.toml").write_text('profile = "production"\n')
    settings = load(environ={"XDG_CONFIG_HOME": str(tmp_path)})
    assert settings.profile == "production"
    assert settings.source == tmp_path / "lucia/machine.toml"
