"""The shipped units are the template rendered for each shipped recipe, and say what they must."""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "units" / "lucia-worker.service.in"
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_each_recipe_has_its_rendered_unit(recipe: Path) -> None:
    unit = ROOT / "units" / f"lucia-{recipe.stem}.service"
    assert unit.read_text() == TEMPLATE.read_text().replace("@NAME@", recipe.stem)


def _parsed(unit: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(unit.read_text())
    return parser


def test_the_unit_is_a_notify_service_with_a_watchdog() -> None:
    parser = _parsed(TEMPLATE)
    service = parser["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "78"
    assert "worker @NAME@" in service["ExecStart"]
    assert parser["Install"]["WantedBy"] == "default.target"
    environment = TEMPLATE.read_text()
    for variable in ("LUCIA_DATA_DIR", "LUCIA_RECIPES_DIR", "LUCIA_STATE_DIR"):
        assert f"Environment={variable}=" in environment


GATEWAY = ROOT / "units" / "lucia-gateway.service"
INSTALL = ROOT / "install.sh"


def test_the_gateway_unit_is_a_notify_service_with_a_watchdog_in_the_journal() -> None:
    parser = _parsed(GATEWAY)
    service = parser["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert int(service["WatchdogSec"]) > 0
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "78"  # bad settings or keys
    assert service["ExecStart"].endswith("/lucia-supervisor gateway")
    assert (service["StandardOutput"], service["StandardError"]) == ("journal", "journal")
    assert service["SyslogIdentifier"] == "lucia-gateway"
    assert "Environment=LUCIA_DATA_DIR=" in GATEWAY.read_text()
    # streams in flight get the service's 20 s before the unit's stop timeout kills it
    assert int(service["TimeoutStopSec"]) > 20


def test_install_sh_installs_the_gateway_unit_but_never_starts_or_enables_it() -> None:
    script = INSTALL.read_text()
    assert 'place "$src/units/lucia-gateway.service" "$units/lucia-gateway.service" 0644' in script
    commands = [line for line in script.splitlines() if "systemctl_user" in line]
    assert commands and not any("gateway" in line for line in commands)
    assert "recipe file name gateway is taken" in script  # no engine unit may replace it


MODELS = ROOT / "units" / "lucia-models.service"


def test_the_models_unit_runs_the_queue_as_a_notify_service_installed_stopped() -> None:
    service = _parsed(MODELS)["Service"]
    assert service["Type"] == "notify"
    assert service["ExecStart"].endswith("/lucia-supervisor models serve")
    assert service["RestartPreventExitStatus"] == "78"  # the lease is held by another
    assert "Environment=LUCIA_MODELS_DIR=" in MODELS.read_text()
    assert service["SyslogIdentifier"] == "lucia-models"
    script = INSTALL.read_text()
    assert 'place "$src/units/lucia-models.service" "$units/lucia-models.service" 0644' in script
    commands = [line for line in script.splitlines() if "systemctl_user" in line]
    assert not any("models" in line for line in commands)
    assert "recipe file name models is taken" in script
