"""Debian's chromium, driven by selenium through chromium-driver (headless, nothing downloaded),
for the tests that open the operator's page: the browser, waits on what the page shows, its
sign-in, and the screenshots written under $LUCIA_PAGE_SCREENSHOTS (default:
<tmp>/lucia-page-screenshots).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 30  # the page polls every 2 s
# the page redraws a section whose data changed: an element found before may be gone
RETRY = (NoSuchElementException, StaleElementReferenceException)


@contextlib.contextmanager
def chromium(network_log: bool = False) -> Iterator[WebDriver]:
    """A headless Chromium; with `network_log`, its DevTools network events are kept, to be
    read after the fact with NetworkLog (what it received, whenever it received it)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1600",
    ):
        options.add_argument(argument)
    if network_log:
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    driver = webdriver.Chrome(
        options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER)
    )
    try:
        yield driver
    finally:
        driver.quit()


class NetworkLog:
    """What a browser started with `network_log` received, gathered each time it is read."""

    def __init__(self, driver: WebDriver) -> None:
        self.driver = driver
        self._answers: dict[str, dict[str, Any]] = {}  # by requestId, in the order they came
        self._headers: dict[str, dict[str, str]] = {}

    def answers(self, path: str) -> list[dict[str, Any]]:
        """The answers so far to URLs ending in `path`: url, status, requestId and the raw
        headers (Set-Cookie included), in order."""
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            params = message.get("params", {})
            if message.get("method") == "Network.responseReceived":
                response = params["response"]
                self._answers[params["requestId"]] = {
                    "requestId": params["requestId"],
                    "url": response["url"],
                    "status": response["status"],
                }
            elif message.get("method") == "Network.responseReceivedExtraInfo":
                self._headers[params["requestId"]] = params.get("headers", {})
        return [
            {**answer, "headers": self._headers.get(key, {})}
            for key, answer in self._answers.items()
            if answer["url"].endswith(path)
        ]

    def body(self, request_id: str) -> str:
        """The body of an answer the browser still holds."""
        found = self.driver.execute_cdp_cmd("Network.getResponseBody", {"requestId": request_id})
        return str(found["body"])


def shots() -> Path:
    where = Path(
        os.environ.get("LUCIA_PAGE_SCREENSHOTS")
        or Path(tempfile.gettempdir()) / "lucia-page-screenshots"
    )
    where.mkdir(parents=True, exist_ok=True)
    return where


def shot(driver: WebDriver, name: str) -> Path:
    path = shots() / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def until(driver: WebDriver, check: Any, timeout: float = WAIT_S, what: str = "") -> Any:
    wait = WebDriverWait(driver, timeout, poll_frequency=0.2, ignored_exceptions=RETRY)
    return wait.until(check, message=what)


def press(driver: WebDriver, css: str) -> None:
    """Click the element now matching css (found again if a redraw replaced it)."""
    until(driver, lambda d: d.find_element(By.CSS_SELECTOR, css).click() or True, what=css)


def text(driver: WebDriver, css: str) -> str:
    return str(until(driver, lambda d: [d.find_element(By.CSS_SELECTOR, css).text], what=css)[0])


def visible(driver: WebDriver, element_id: str) -> bool:
    return driver.find_element(By.ID, element_id).is_displayed()


def engine(name: str) -> str:
    return f'.engine[data-engine="{name}"]'


def engine_state(driver: WebDriver, name: str) -> str | None:
    try:
        return driver.find_element(By.CSS_SELECTOR, engine(name) + " .state").text
    except RETRY:
        return None


def sign_in(driver: WebDriver, url: str, key: str) -> None:
    """Open the page of the gateway at `url` and sign in with `key` through its form."""
    driver.get(url + "/page/")
    until(driver, lambda d: visible(d, "signin-view"), what="the sign-in form")
    field = driver.find_element(By.ID, "owner-key")
    field.clear()
    field.send_keys(key)
    driver.find_element(By.CSS_SELECTOR, "#signin button").click()


def post(driver: WebDriver, path: str, body: str, headers: dict[str, str] | None = None) -> int:
    """A same-origin POST from the page with its cookies (and `headers`): the status."""
    return int(
        driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0], {method: 'POST', credentials: 'same-origin',"
            " headers: Object.assign({'Content-Type': 'application/json'}, arguments[2]),"
            " body: arguments[1]}).then(r => done(r.status), e => done(0));",
            path,
            body,
            headers or {},
        )
    )
