"""The operator's page in a real browser (Debian's chromium, driven by selenium through
chromium-driver, headless, nothing downloaded) against the real gateway process and a real
worker on the real llama-server router.

In order, as an operator would: an inference key is refused; the owner signs in and sees the
engine stopped; markup in a worker's message and plan shows as text; start, and the engine
reaches running; the memory plans of three more (stopped) engines show as the reserves, the
running engine's claim and what is free, and a need bar each, and the one that cannot fit says
so and has its Start disabled, until another engine changes after its plan; a change without
the CSRF token is refused; a key is created, shown once, used and revoked, and between, a chat
made with it shows as the key's last use and spending and in the traffic; a model is added from
the tests' (slow) hub, its progress bar moves, it is Ready and removed; a signed-out session's
cookie opens nothing; stop. And on a gateway of its own whose sessions last a few seconds
(`[page] session_s`): once the session is over the page shows the sign-in form on its next
poll, and the expired cookie, put back, changes nothing. A screenshot
of each screen is written under $LUCIA_PAGE_SCREENSHOTS (default: <tmp>/lucia-page-screenshots).
"""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import docker
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from supervisor import paths
from supervisor.host.page.routes import COOKIE, COOKIE_PATH, CSRF_HEADER
from supervisor.memplan.preview import NOT_PLANNED
from supervisor.protocol.documents import MemoryPlan
from supervisor.protocol.reads import load_status
from tests.browser import (
    RETRY,
    WAIT_S,
    NetworkLog,
    chromium,
    engine,
    engine_state,
    post,
    press,
    shot,
    sign_in,
    text,
    until,
    visible,
)
from tests.fixtures import Engine, own_recipe_factory
from tests.gateway_proc import Gateway, running_gateway
from tests.gguf_fixtures import TinyLlama, add_model, write_llama
from tests.host.gateway_world import write_status
from tests.host.library_world import GGUF, REPO, cli_env, hub_of, make_repo, serve
from tests.hub_standin import Hub
from tests.system.harness import wait_for

pytestmark = pytest.mark.docker

HOSTILE = "<img src=x onerror=document.title='owned'>"
GiB = 1024**3
START_S = 180  # a router start: the model cache, the container, /models
GGUF_ELEMENTS = 32_768  # 128 KiB of tensor: some 16 s from the slow hub
SESSION_S = 3  # the short-lived gateway's [page] session_s


@pytest.fixture(scope="module")
def router(
    client: docker.DockerClient,
    base_image: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Engine]:
    """A llama-router engine with one tiny model, its worker running and the engine stopped."""
    directory = tmp_path_factory.mktemp("page-router")
    factory = own_recipe_factory(client, base_image, directory, request)
    engine = factory(kind="llama-router", models_max=1)
    engine.models_dir.mkdir(exist_ok=True)
    write_llama(add_model(engine.models_dir, "Ready") / "alpha.gguf", TinyLlama())
    engine.start_worker()
    engine.wait_state(engine.request("stopped"), "stopped", timeout=60)
    yield engine
    factory.close()


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    """The tests' hub, slow: a download lasts long enough to see its bar move."""
    repo = make_repo(tmp_path_factory.mktemp("page-hub"), elements=GGUF_ELEMENTS)
    with hub_of(repo, slow=True) as standin:
        yield standin


@pytest.fixture(scope="module")
def library(hub: Hub, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The model library's environment (its folder, the hub), and its service running on it."""
    env = cli_env(tmp_path_factory.mktemp("page-library") / "models", hub)
    service = serve(env)
    try:
        yield env
    finally:
        service.send_signal(signal.SIGTERM)
        service.communicate(timeout=60)


@pytest.fixture(scope="module")
def gateway(
    router: Engine, library: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    with pytest.MonkeyPatch.context() as patch:  # the gateway's page adds to that library
        for name in ("LUCIA_MODELS_DIR", "HF_ENDPOINT", "LUCIA_HF_TOKEN_FILE"):
            patch.setenv(name, library[name])
        with running_gateway(tmp_path_factory.mktemp("page-gateway"), router.data_dir) as gw:
            yield gw


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    with chromium() as driver:
        yield driver


def post_without_csrf(driver: WebDriver, path: str, body: str) -> int:
    """A same-origin POST from the page, with the session cookie and no CSRF token."""
    return post(driver, path, body)


def router_plan(router: Engine) -> MemoryPlan:
    """The plan the router's worker publishes at each look: this machine's limit and reserves."""
    found: list[MemoryPlan] = []

    def published() -> bool:
        status = load_status(router.data_dir / router.name)
        found[:] = [status.memory] if status is not None and status.memory is not None else []
        return bool(found)

    wait_for(published, WAIT_S, "the router's memory plan in its status")
    return found[0]


def memory_plan(like: MemoryPlan, need: int | None, fits: bool, message: str = "") -> MemoryPlan:
    """Another engine's plan as its worker would publish it on this machine (as `like`'s),
    made now: after every engine's status written before it (else it is outdated)."""
    when = datetime.now(UTC)
    return like.model_copy(
        update={"need": need, "fits": fits, "message": message, "planned_at": when}
    )


def test_an_inference_key_cannot_open_the_page(browser: WebDriver, gateway: Gateway) -> None:
    sign_in(browser, gateway.url, gateway.inference)
    until(browser, lambda d: visible(d, "signin-problem"), what="the refusal")
    assert "the page is the owner's" in browser.find_element(By.ID, "signin-problem").text
    assert not visible(browser, "main-view")
    assert browser.get_cookies() == []
    shot(browser, "1-inference-key-refused")


def test_the_owner_signs_in_and_sees_the_engine_stopped(
    browser: WebDriver, gateway: Gateway, router: Engine
) -> None:
    sign_in(browser, gateway.url, gateway.owner)
    until(browser, lambda d: engine_state(d, router.name) == "stopped", what="the engine")
    assert not visible(browser, "signin-view")
    cookie = next(c for c in browser.get_cookies() if c["name"] == COOKIE)
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/page/"
    assert gateway.owner not in cookie["value"]
    assert "No model in the library" in text(browser, "#models-body")
    until(
        browser,
        lambda d: "0 requests" in d.find_element(By.ID, "traffic-body").text,
        what="the record's traffic, nothing yet",
    )
    shot(browser, "2-engines-stopped")


def test_markup_in_a_message_shows_as_text(
    browser: WebDriver, gateway: Gateway, router: Engine
) -> None:
    old = datetime.now(UTC) - timedelta(seconds=120)
    unfit = memory_plan(router_plan(router), need=GiB, fits=False, message=HOSTILE)
    write_status(
        router.data_dir,
        "hostile",
        "failed",
        message=HOSTILE,
        models=("evil<b>",),
        checked_at=old,
        memory=unfit,
    )
    until(browser, lambda d: engine_state(d, "hostile") == "failed", what="the hostile engine")
    assert text(browser, engine("hostile") + " .message") == HOSTILE
    assert text(browser, engine("hostile") + " .cannot-fit") == "cannot fit: " + HOSTILE
    assert text(browser, '.need[data-engine="hostile"] .message') == HOSTILE
    until(
        browser,
        lambda d: d.find_element(By.CSS_SELECTOR, engine("hostile") + " .stale").is_displayed(),
        what="the old heartbeat marked",
    )
    assert "s old" in text(browser, engine("hostile") + " .stale")
    assert not browser.find_element(By.CSS_SELECTOR, engine(router.name) + " .stale").is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, "#engine-list img, #engine-list b") == []
    assert browser.find_elements(By.CSS_SELECTOR, "#memory-body img, #memory-body b") == []
    assert browser.title != "owned"
    shot(browser, "3-markup-as-text")
    (router.data_dir / "hostile" / "status.json").unlink()
    until(browser, lambda d: engine_state(d, "hostile") is None, what="the hostile engine gone")


def test_start_reaches_running_and_memory_shows_its_claim(
    browser: WebDriver, gateway: Gateway, router: Engine
) -> None:
    press(browser, engine(router.name) + " button.act-running")
    until(
        browser,
        lambda d: engine_state(d, router.name) == "running",
        START_S,
        what="the engine running",
    )
    assert "http://" in text(browser, engine(router.name))  # its url
    shot(browser, "4-engine-running")
    until(
        browser,
        lambda d: router.name in d.find_element(By.ID, "memory-body").text,
        what="the engine's claim in the memory bars",
    )
    browser.execute_script("document.getElementById('memory').scrollIntoView()")
    shot(browser, "5-memory")


def test_memory_shows_the_plan_and_a_start_that_cannot_fit(
    browser: WebDriver, gateway: Gateway, router: Engine
) -> None:
    """Two stopped engines' plans (the worker side writes them; here the test does): the
    reserves and the running engine's claim against the limit, each need as a bar, and the one
    that cannot fit says so and has its Start disabled before anything is asked."""
    like = router_plan(router)
    reserved = sum(like.reserves.model_dump().values())
    left = like.limit - reserved
    need = max(left, 0) + 4 * GiB
    refusal = (
        "qwen3-32b does not fit after voice, OS, services, and runtime reservations: "
        f"needs {need / GiB:.1f} GiB, {left / GiB:.1f} GiB left (limit "
        f"{like.limit / GiB:.1f}, reserves {reserved / GiB:.1f}, held by {router.name} 0.0). "
        f"Lower the context or stop {router.name}."
    )
    write_status(
        router.data_dir,
        "spare",
        "stopped",
        models=("qwen3-0.6b",),
        memory=memory_plan(like, GiB, True),
    )
    write_status(
        router.data_dir, "later", "stopped", memory=memory_plan(like, None, True, NOT_PLANNED)
    )
    write_status(
        router.data_dir,
        "big",
        "stopped",
        models=("qwen3-32b",),
        memory=memory_plan(like, need, False, refusal),
    )
    big = engine("big")
    until(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, big + " .cannot-fit"),
        what="the engine that cannot fit marked",
    )
    assert text(browser, big + " .cannot-fit") == "cannot fit: " + refusal
    start = browser.find_element(By.CSS_SELECTOR, big + " button.act-running")
    assert not start.is_enabled() and start.get_attribute("title") == "cannot fit: " + refusal
    assert "planned" in text(browser, big + " .plan-age")
    assert browser.find_element(
        By.CSS_SELECTOR, engine("spare") + " button.act-running"
    ).is_enabled()
    assert "fits now" in text(browser, engine("spare") + " .plan")
    assert text(browser, engine("later") + " .plan-message") == NOT_PLANNED
    assert browser.find_element(By.CSS_SELECTOR, engine("later") + " .act-running").is_enabled()
    assert browser.find_element(
        By.CSS_SELECTOR, engine(router.name) + " button.act-running"
    ).is_enabled()
    browser.execute_script(
        "arguments[0].scrollIntoView()", browser.find_element(By.CSS_SELECTOR, big)
    )
    shot(browser, "5b-cannot-fit")
    body = "#memory-body"
    until(
        browser,
        lambda d: "reserves from" in d.find_element(By.CSS_SELECTOR, body).text,
        what="the limit and reserves from a plan",
    )
    reserves = [
        e.text for e in browser.find_elements(By.CSS_SELECTOR, body + " .legend li.reserve")
    ]
    assert [r.split(":")[0] for r in reserves] == [
        "reserve, OS",
        "reserve, services",
        "reserve, voice",
        "reserve, runtime",
    ]
    assert f"limit {like.limit / GiB:.1f} GiB" in text(browser, body)
    assert router.name + " (held)" in text(browser, body + " .legend li.held")
    assert text(browser, body + " .legend li.free").startswith("free: ")
    unfit = '.need[data-engine="big"]'
    assert text(browser, unfit + " .verdict") == "cannot fit"
    assert text(browser, unfit + " .message") == refusal
    assert browser.find_elements(By.CSS_SELECTOR, unfit + " .bar .seg-unfit")
    assert text(browser, '.need[data-engine="spare"] .verdict') == "fits"
    assert text(browser, '.need[data-engine="later"] .verdict') == "not planned"
    browser.execute_script("document.getElementById('memory').scrollIntoView()")
    shot(browser, "5c-memory-plan")
    browser.set_window_size(390, 1400)
    try:
        width = browser.execute_script("return document.documentElement.scrollWidth")
        assert width <= 400, "nothing wider than the phone"
        browser.execute_script("document.getElementById('memory').scrollIntoView()")
        shot(browser, "5d-memory-phone")
    finally:
        browser.set_window_size(1280, 1600)
    # spare's state changes after big's plan was made: what spare holds may have changed the
    # verdict, so big's Start is not held back on it until its worker looks again
    write_status(
        router.data_dir,
        "spare",
        "failed",
        models=("qwen3-0.6b",),
        memory=memory_plan(like, GiB, True),
    )
    until(
        browser,
        lambda d: d.find_elements(By.CSS_SELECTOR, big + " .may-not-fit"),
        what="big's refusal marked as planned before spare changed",
    )
    assert text(browser, big + " .may-not-fit") == "may not fit: " + refusal
    assert text(browser, big + " .plan-outdated") == "planned before spare changed"
    assert browser.find_element(By.CSS_SELECTOR, big + " button.act-running").is_enabled()
    assert text(browser, unfit + " .verdict") == "may not fit"
    for name in ("big", "spare", "later"):
        (router.data_dir / name / "status.json").unlink()
    until(browser, lambda d: engine_state(d, "big") is None, what="the extra engines gone")


def test_a_change_without_the_csrf_token_is_refused(
    browser: WebDriver, gateway: Gateway, router: Engine
) -> None:
    assert post_without_csrf(browser, f"api/engines/{router.name}", '{"desired": "stopped"}') == 403
    assert post_without_csrf(browser, "api/keys", '{"name": "sneaky"}') == 403
    desired = (router.data_dir / router.name / "desired.json").read_text()
    assert '"running"' in desired
    assert "sneaky" not in browser.find_element(By.ID, "key-rows").text


def test_a_key_is_created_shown_once_used_and_revoked(browser: WebDriver, gateway: Gateway) -> None:
    browser.find_element(By.ID, "key-name").send_keys("laptop")
    browser.find_element(By.CSS_SELECTOR, "#key-create button").click()
    until(browser, lambda d: visible(d, "key-new"), what="the new key")
    secret = browser.find_element(By.ID, "key-secret").text
    assert secret.startswith("lucia_inf_")
    browser.execute_script("document.getElementById('keys').scrollIntoView()")
    shot(browser, "6-key-created")
    wait_for(lambda: gateway.get("/v1/models", secret)[0] == 200, 10, "the new key accepted")
    browser.find_element(By.ID, "key-done").click()
    assert secret not in browser.page_source, "shown once"
    browser.refresh()
    until(browser, lambda d: "laptop" in d.find_element(By.ID, "key-rows").text, what="listed")
    assert secret not in browser.page_source
    answer = gateway.client(secret).chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "Hello"}], max_tokens=4
    )
    used = answer.usage.total_tokens if answer.usage else 0
    laptop = "//tr[td[@class='key-name' and text()='laptop']]"
    until(
        browser,
        lambda d: "T" in d.find_element(By.XPATH, laptop + "/td[@class='last-use']").text,
        what="the key's last use",
    )
    spent = browser.find_element(By.XPATH, laptop + "/td[@class='spent']").text
    assert spent.startswith(f"{used} tokens, 1 requests"), spent
    shot(browser, "6b-key-used")
    until(
        browser,
        lambda d: "1 requests" in d.find_element(By.CSS_SELECTOR, ".span-hour").text,
        what="the chat in the traffic",
    )
    hour = browser.find_element(By.CSS_SELECTOR, ".span-hour .by-model").text
    assert "alpha" in hour
    assert browser.find_elements(By.CSS_SELECTOR, "#traffic svg polyline.series")
    browser.execute_script("document.getElementById('traffic').scrollIntoView()")
    shot(browser, "6c-traffic")
    revoke = "//tr[td[@class='key-name' and text()='laptop']]//button[@class='revoke']"
    until(browser, lambda d: d.find_element(By.XPATH, revoke).click() or True, what="revoke")
    until(
        browser,
        lambda d: "laptop" not in d.find_element(By.ID, "key-rows").text,
        what="the revoked key gone",
    )
    wait_for(lambda: gateway.get("/v1/models", secret)[0] == 401, 10, "the key refused")
    shot(browser, "7-key-revoked")


def test_an_exempt_key_shows_as_exempt_with_its_spending(
    browser: WebDriver, gateway: Gateway
) -> None:
    radar = gateway.create_key("radar", "--exempt")
    laptop = gateway.create_key("laptop2", "--budget", "5000")
    for key in (radar, laptop):
        gateway.client(key).chat.completions.create(
            model="alpha", messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
    browser.refresh()
    row = "//tr[td[@class='key-name' and text()='{}']]/td[@class='{}']"
    until(
        browser,
        lambda d: (
            "exempt from the budget" in d.find_element(By.XPATH, row.format("radar", "spent")).text
        ),
        what="the exempt key's spending",
    )
    assert browser.find_element(By.XPATH, row.format("radar", "budget")).text == "exempt"
    assert browser.find_element(By.XPATH, row.format("laptop2", "budget")).text == "5000"
    until(
        browser,
        lambda d: (
            "1 requests of 5000 (" in d.find_element(By.XPATH, row.format("laptop2", "spent")).text
        ),
        what="the budgeted key's spending against its budget",
    )
    browser.execute_script("document.getElementById('keys').scrollIntoView()")
    shot(browser, "7b-key-exempt")


def bar(driver: WebDriver) -> tuple[str, int, int] | None:
    """The model's state and the bytes done and total its progress bar shows."""
    try:
        model = driver.find_element(By.CSS_SELECTOR, ".model")
        shown = model.find_element(By.CSS_SELECTOR, ".bar")
        return (
            model.find_element(By.CSS_SELECTOR, ".state").text,
            int(shown.get_attribute("data-done") or 0),
            int(shown.get_attribute("data-total") or 0),
        )
    except RETRY:
        return None


def test_a_model_is_added_and_its_progress_bar_moves(browser: WebDriver, library: Any) -> None:
    for field, value in (
        ("model-repo", REPO),
        ("model-revision", "main"),
        ("model-include", GGUF),
        ("model-name", "tiny"),
    ):
        browser.find_element(By.ID, field).send_keys(value)
    browser.find_element(By.CSS_SELECTOR, "#model-add button").click()
    # the hf CLI writes a file in large blocks: the bar shows the bytes that came so far
    first = until(
        browser,
        lambda d: (b := bar(d)) and b[0] == "Downloading" and b[1] > 0 and b,
        START_S,
        what="the download under way",
    )
    assert first[1] < first[2], "under way, not done"
    assert text(browser, ".model .name") == "tiny"
    assert text(browser, ".model .source").startswith(f"{REPO} @ main")
    browser.execute_script("document.getElementById('models').scrollIntoView()")
    shot(browser, "7a-model-downloading")
    done = until(
        browser, lambda d: (b := bar(d)) and b[1] > first[1] and b, START_S, what="the bar moving"
    )
    assert done[2] == first[2]
    until(browser, lambda d: text(d, ".model .state") == "Ready", START_S, what="Ready")
    assert "100.0%" in text(browser, ".model .figures")
    shot(browser, "7b-model-ready")
    press(browser, ".model button.act-remove")
    browser.switch_to.alert.accept()
    until(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, ".model"), what="removed")


def test_the_phone_width(browser: WebDriver, router: Engine) -> None:
    browser.set_window_size(390, 1400)
    try:
        until(browser, lambda d: engine_state(d, router.name) == "running", what="the engine")
        width = browser.execute_script("return document.documentElement.scrollWidth")
        assert width <= 400, "nothing wider than the phone"
        shot(browser, "8-phone")
    finally:
        browser.set_window_size(1280, 1600)


def test_stop_and_a_signed_out_session_opens_nothing(
    browser: WebDriver, gateway: Gateway, router: Engine
) -> None:
    press(browser, engine(router.name) + " button.act-stopped")
    until(
        browser,
        lambda d: engine_state(d, router.name) == "stopped",
        START_S,
        what="the engine stopped",
    )
    old = next(c for c in browser.get_cookies() if c["name"] == COOKIE)
    browser.find_element(By.ID, "signout").click()
    until(browser, lambda d: visible(d, "signin-view"), what="signed out")
    browser.add_cookie({"name": old["name"], "value": old["value"], "path": old["path"]})
    browser.get(gateway.url + "/page/")
    until(browser, lambda d: visible(d, "signin-view"), what="the sign-in form again")
    assert not visible(browser, "main-view")
    status = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch('api/overview').then(r => done(r.status));"
    )
    assert status == 401
    shot(browser, "9-signed-out")


@pytest.fixture
def short_sessions(tmp_path: Path) -> Iterator[Gateway]:
    """A gateway of its own whose sessions last SESSION_S seconds, over one stopped engine."""
    data = tmp_path / "data"
    write_status(data, "brief", "stopped")
    settings = f"[page]\nsession_s = {SESSION_S}\n"
    with running_gateway(tmp_path / "gateway", data, settings) as gw:
        yield gw


def session_status(gateway: Gateway, token: str) -> int:
    """What the gateway answers GET /page/api/session with this cookie token."""
    request = urllib.request.Request(gateway.url + "/page/api/session")
    request.add_header("Cookie", f"{COOKIE}={token}")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


def test_an_expired_session_shows_the_sign_in_form_and_changes_nothing(
    short_sessions: Gateway,
) -> None:
    gateway = short_sessions
    keys_file = paths.keys_file(gateway.data_dir)
    with chromium(network_log=True) as driver:
        log = NetworkLog(driver)
        sign_in(driver, gateway.url, gateway.owner)

        def signed_out_again(d: WebDriver) -> bool:
            polls = [a["status"] for a in log.answers("/page/api/overview")]
            return 200 in polls and polls[-1] == 401 and visible(d, "signin-view")

        # it polled with the session, then a poll found the session over: the form again
        until(driver, signed_out_again, SESSION_S + WAIT_S, what="the form after the session")
        assert not visible(driver, "main-view")
        shot(driver, "10-session-expired")
        signed = [a for a in log.answers("/page/api/signin") if a["status"] == 200]
        assert len(signed) == 1
        header = {k.lower(): v for k, v in signed[0]["headers"].items()}["set-cookie"]
        cookie = SimpleCookie()
        cookie.load(header)
        assert cookie[COOKIE]["max-age"] == str(SESSION_S), header
        token = cookie[COOKIE].value
        csrf = json.loads(log.body(signed[0]["requestId"]))["csrf"]
        # the gateway itself ended the session (not only the browser its cookie)
        wait_for(lambda: session_status(gateway, token) == 401, WAIT_S, "the session over")
        before = keys_file.read_bytes()
        driver.add_cookie({"name": COOKIE, "value": token, "path": COOKIE_PATH})  # no expiry now
        assert post(driver, "api/keys", '{"name": "after-expiry"}', {CSRF_HEADER: csrf}) == 401
        assert keys_file.read_bytes() == before, "no key created"
        assert "after-expiry" not in gateway.cli("keys", "list").stdout
        assert visible(driver, "signin-view")
