"""The page in a fleet in a real browser (Debian's chromium, headless, driven by selenium):
machine a's page shows b's and c's engines grouped by machine, another machine's hostile names
as text, a stale machine with its Start and Stop disabled, and the owner's Stop of b's engine
reaching b's desired.json, naming machine a. Real gateway processes on loopback, one
PostgreSQL catalog (test_fleet_routing's three machines)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from supervisor.protocol.layout import engine_dir
from supervisor.protocol.reads import read_desired
from tests.browser import chromium, press, shot, sign_in, text, until, visible
from tests.host.test_fleet_page import plant
from tests.host.test_fleet_routing import Three, three_machines
from tests.postgres import Cluster
from tests.standin import free_port

HOSTILE_MACHINE = "<img src=x onerror=document.title='owned'>"
HOSTILE_ENGINE = "<script>document.title='owned'</script>"


@pytest.fixture
def fleet(postgres: Cluster, tmp_path: Path) -> Iterator[Three]:
    with three_machines(postgres, tmp_path) as made:
        yield made


@pytest.fixture
def driver() -> Iterator[WebDriver]:
    with chromium() as made:
        yield made


def machine(name: str) -> str:
    return f'.machine[data-machine="{name}"]'


def test_machine_as_page_shows_the_fleet_as_text_and_stops_bs_engine(
    fleet: Three, driver: WebDriver
) -> None:
    fleet.fresh()
    nowhere = f"http://127.0.0.1:{free_port()}"
    plant(fleet.dsn, HOSTILE_MACHINE, nowhere, HOSTILE_ENGINE, fresh=True)
    plant(fleet.dsn, "gone", nowhere, "small", fresh=False)
    a = fleet.gateways["a"]
    sign_in(driver, a.url, a.owner)
    until(driver, lambda d: visible(d, "fleet"), what="the other machines")
    for name in ("b", "c", "gone"):
        until(
            driver, lambda d, name=name: d.find_elements(By.CSS_SELECTOR, machine(name)), what=name
        )
    assert text(driver, f"{machine('b')} .engine .name") == "small"
    assert "own-b, shared" in text(driver, machine("b"))
    assert "last heard" in text(driver, f"{machine('b')} .heard")
    # the hostile names are text: no element made of them, nothing run
    group = until(
        driver,
        lambda d: [
            g
            for g in d.find_elements(By.CSS_SELECTOR, ".machine")
            if g.get_attribute("data-machine") == HOSTILE_MACHINE
        ],
        what="the hostile machine",
    )[0]
    assert group.find_element(By.CSS_SELECTOR, "h3 .name").text == HOSTILE_MACHINE
    assert group.find_element(By.CSS_SELECTOR, ".engine .name").text == HOSTILE_ENGINE
    assert not driver.find_elements(By.CSS_SELECTOR, "#machine-list img, #machine-list script")
    assert driver.title != "owned"
    # a stale machine: said, and not asked
    assert "stale" in text(driver, f"{machine('gone')} h3")
    for button in driver.find_elements(By.CSS_SELECTOR, f"{machine('gone')} button"):
        assert not button.is_enabled()
    shot(driver, "fleet-page")
    before = read_desired(engine_dir(a.data_dir, "small"))
    press(driver, f"{machine('b')} .engine .act-stopped")

    def stopped() -> bool:
        written = read_desired(engine_dir(fleet.gateways["b"].data_dir, "small"))
        return written is not None and (written.desired, written.requested_by) == (
            "stopped",
            "operator@a",
        )

    until(driver, lambda _: stopped(), what="b's engine asked to stop, by machine a")
    assert read_desired(engine_dir(a.data_dir, "small")) == before  # a's own engine: untouched
    with psycopg.connect(fleet.dsn, autocommit=True) as conn:  # the test's own rows go
        conn.execute(
            "DELETE FROM fleet_machines WHERE machine = ANY(%s)", ([HOSTILE_MACHINE, "gone"],)
        )
