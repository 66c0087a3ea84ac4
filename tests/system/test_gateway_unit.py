"""The lucia-gateway systemd user unit as install.sh installs it, under the test user's real user
manager: installed stopped and not enabled; with a settings file and the two key files in its
~/.config/lucia it is active only once it listens (Type=notify, READY after the bind), its
journal has the start line and never a key, and a frozen gateway is restarted by the watchdog.
The operator's page opens from it as an operator opens it: its files from the installed package,
its headers, the sign-in and its cookie, the JSON the page reads and a change it makes, over
HTTP and in Chromium.

The cases run in order against the session's installation; the module removes what it wrote.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.cookies import SimpleCookie
from typing import Any

import pytest

from supervisor.host.page.routes import COOKIE, CSRF_HEADER
from supervisor.protocol.documents import Status, dump, utc_now
from tests.browser import chromium, engine_state, shot, sign_in, until, visible
from tests.standin import free_port
from tests.system.harness import RUN_ID, USER, Installation, as_user, show, systemctl, wait_for

pytestmark = pytest.mark.system

UNIT = "lucia-gateway.service"


@dataclass(frozen=True)
class Configured:
    port: int
    owner: str
    inference: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _write_as_user(path: str, text: str) -> None:
    """A file of the test user's, 0600, its content through stdin (a key never in an argument
    list)."""
    as_user(
        "sh",
        "-c",
        f'umask 077 && mkdir -p "$(dirname {path})" && cat > {path}.tmp && mv {path}.tmp {path}',
        input=text,
    )


def _journal_lines(match: str, since: float) -> list[str]:
    """The journal's non-empty lines since `since` that match (a journalctl match or -t)."""
    result = subprocess.run(
        ["journalctl", *match.split(), "--no-pager", "-o", "cat", "--since", f"@{int(since) - 1}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in result.stdout.splitlines() if line.strip()]


def _journal(since: float) -> list[str]:
    """The test user's gateway's lines since `since`, by its SyslogIdentifier and the user (the
    operator's own lucia-gateway may log beside it)."""
    return _journal_lines(f"-t lucia-gateway _UID={pwd.getpwnam(USER).pw_uid}", since)


def _get(url: str, key: str | None = None) -> int:
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


@dataclass(frozen=True)
class Answer:
    status: int
    headers: Any  # an http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _page(
    configured: Configured,
    path: str,
    body: dict[str, Any] | None = None,
    cookie: str | None = None,
    csrf: str | None = None,
) -> Answer:
    """A page request as the page makes it: JSON in, the session cookie and the CSRF header."""
    request = urllib.request.Request(
        configured.url + "/page" + path,
        method="GET" if body is None else "POST",
        data=None if body is None else json.dumps(body).encode(),
    )
    request.add_header("Content-Type", "application/json")
    if cookie is not None:
        request.add_header("Cookie", f"{COOKIE}={cookie}")
    if csrf is not None:
        request.add_header(CSRF_HEADER, csrf)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return Answer(answer.status, answer.headers, answer.read())
    except urllib.error.HTTPError as error:
        return Answer(error.code, error.headers, error.read())


def _dropin(installation: Installation) -> str:
    return str(installation.home / ".config/systemd/user" / f"{UNIT}.d")


@pytest.fixture(scope="module")
def configured(installation: Installation) -> Iterator[Configured]:
    """gateway.toml on a free port and the two key files, in the test user's ~/.config/lucia."""
    config = installation.home / ".config/lucia"
    settings = Configured(free_port(), secrets.token_urlsafe(32), secrets.token_urlsafe(32))
    _write_as_user(str(config / "owner.key"), settings.owner + "\n")
    _write_as_user(str(config / "inference.key"), settings.inference + "\n")
    _write_as_user(str(config / "gateway.toml"), f"[listen]\nport = {settings.port}\n")
    yield settings
    systemctl("stop", UNIT, check=False)
    as_user("rm", "-rf", _dropin(installation), check=False)
    systemctl("daemon-reload", check=False)
    systemctl("reset-failed", UNIT, check=False)
    as_user(
        "rm",
        "-f",
        *(str(config / name) for name in ("owner.key", "inference.key", "gateway.toml")),
        check=False,
    )
    as_user("rm", "-f", str(installation.data_dir / "telemetry" / "_gateway.json"), check=False)


def test_installed_stopped_and_not_enabled(installation: Installation) -> None:
    unit_file = installation.home / ".config/systemd/user" / UNIT
    assert unit_file.is_file()
    assert show(UNIT, "ActiveState") == "inactive"
    assert systemctl("is-enabled", UNIT, check=False).stdout.strip() == "disabled"
    assert show(UNIT, "Type") == "notify"
    assert show(UNIT, "NotifyAccess") == "main"
    verify = as_user("systemd-analyze", "--user", "verify", str(unit_file), check=False)
    assert verify.returncode == 0, verify.stderr


def test_start_is_active_only_once_it_listens(
    installation: Installation, configured: Configured
) -> None:
    started = time.time()
    systemctl("start", UNIT)  # returns once READY=1 came (Type=notify)
    assert show(UNIT, "ActiveState") == "active"
    # READY came after the bind: the port answers at once, with no wait
    assert _get(configured.url + "/metrics") == 200
    # the service user's record: SQLite in its data directory, written as it serves
    assert show(UNIT, "StatusText") == f"serving on {configured.url}; recording"
    assert show(UNIT, "WatchdogUSec") == "30s"
    assert _get(configured.url + "/v1/models", configured.inference) == 200
    assert _get(configured.url + "/v1/models", "lucia_inf_" + "0" * 40) == 401
    assert _get(configured.url + "/api/host/engines", configured.inference) == 403
    assert _get(configured.url + "/api/host/engines", configured.owner) == 200
    lines = wait_for(
        lambda: [line for line in _journal(started) if "gateway listening" in line],
        20,
        "the start line",
    )
    assert configured.url in lines[-1]
    journal = "\n".join(_journal(started))
    assert configured.owner not in journal and configured.inference not in journal


@pytest.fixture
def page_engine(installation: Installation) -> Iterator[str]:
    """A stopped engine's status.json in the test user's data directory, for the page to show."""
    name = f"page{RUN_ID}"
    now = utc_now()
    status = Status(
        generation=0,
        state="stopped",
        since=now,
        message="stopped",
        checked_at=now,
        models=("tiny",),
    )
    _write_as_user(str(installation.data_dir / name / "status.json"), dump(status).decode())
    yield name
    as_user("rm", "-rf", str(installation.data_dir / name), check=False)


@pytest.fixture
def page_key(installation: Installation) -> Iterator[str]:
    """The name of the key the page creates: revoked in the end, whatever happened."""
    name = f"page-{RUN_ID}"
    yield name
    as_user(installation.cli, "keys", "revoke", name, check=False)


def test_the_page_opens_from_the_installed_unit(
    installation: Installation, configured: Configured, page_engine: str, page_key: str
) -> None:
    systemctl("start", UNIT)
    started = time.time()
    # the files come from the installed package (package data), not from a source tree
    shipped = list(
        installation.share.glob("venv/lib/python3*/site-packages/supervisor/host/page/static")
    )
    assert len(shipped) == 1, shipped
    source = installation.source / "supervisor/host/page/static"
    for path, name, kind in (
        ("/", "index.html", "text/html"),
        ("/page.js", "page.js", "text/javascript"),
        ("/page.css", "page.css", "text/css"),
    ):
        answer = _page(configured, path)
        assert answer.status == 200 and answer.headers["Content-Type"].startswith(kind), path
        assert answer.body == (source / name).read_bytes() == (shipped[0] / name).read_bytes()
        policy = answer.headers["Content-Security-Policy"]
        assert "script-src 'self';" in policy and "frame-ancestors 'none'" in policy
        assert "unsafe-inline" not in policy and "unsafe-eval" not in policy
        assert answer.headers["X-Content-Type-Options"] == "nosniff"
        assert answer.headers["X-Frame-Options"] == "DENY"
    # the sign-in: a cookie the page's script cannot read, never sent cross-site
    assert _page(configured, "/api/signin", {"key": configured.inference}).status == 403
    signed = _page(configured, "/api/signin", {"key": configured.owner})
    assert signed.status == 200
    header = signed.headers["Set-Cookie"]
    for part in ("HttpOnly", "SameSite=Strict", "Path=/page/", "Max-Age=43200"):
        assert part in header, header
    assert configured.owner not in header
    jar: SimpleCookie = SimpleCookie()
    jar.load(header)
    cookie, csrf = jar[COOKIE].value, signed.json()["csrf"]
    assert _page(configured, "/api/overview").status == 401, "nothing without the session"
    # the JSON the page polls, with the cookie as the page sends it
    assert _page(configured, "/api/session", cookie=cookie).json() == {"csrf": csrf}
    overview = _page(configured, "/api/overview", cookie=cookie)
    assert overview.status == 200
    assert "Content-Security-Policy" in overview.headers
    data = overview.json()
    engines = {row["name"]: row for row in data["engines"]}
    assert engines[page_engine]["status"]["state"] == "stopped"
    assert {"memory", "keys", "models", "traffic"} <= set(data)
    # a change: refused without the CSRF token, made with it, in the test user's keys file
    made = {"name": page_key}
    assert _page(configured, "/api/keys", made, cookie=cookie).status == 403
    created = _page(configured, "/api/keys", made, cookie=cookie, csrf=csrf)
    assert created.status == 201
    key = created.json()
    wait_for(  # the gateway re-reads the keys file it changed
        lambda: _get(configured.url + "/v1/models", key["secret"]) == 200, 10, "the new key"
    )
    listed = _page(configured, "/api/overview", cookie=cookie).json()["keys"]["keys"]
    assert key["id"] in [row["id"] for row in listed]
    revoked = _page(configured, f"/api/keys/{key['id']}/revoke", {}, cookie=cookie, csrf=csrf)
    assert revoked.status == 200 and revoked.json()["state"] == "revoked"
    wait_for(
        lambda: _get(configured.url + "/v1/models", key["secret"]) == 401,
        10,
        "the revoked key refused",
    )
    assert _page(configured, "/api/signout", {}, cookie=cookie, csrf=csrf).status == 200
    assert _page(configured, "/api/overview", cookie=cookie).status == 401
    # and in Chromium, as the operator opens it
    with chromium() as browser:
        sign_in(browser, configured.url, configured.owner)
        until(browser, lambda d: engine_state(d, page_engine) == "stopped", what="the engine")
        assert not visible(browser, "signin-view")
        session = next(c for c in browser.get_cookies() if c["name"] == COOKIE)
        assert session["httpOnly"] and session["sameSite"] == "Strict"
        assert session["path"] == "/page/", "other services on the host are not sent it"
        shot(browser, "11-installed-unit")
    journal = "\n".join(_journal(started))
    for secret in (configured.owner, key["secret"], cookie, csrf):
        assert secret not in journal


def test_a_frozen_gateway_is_restarted_by_the_watchdog(
    installation: Installation, configured: Configured
) -> None:
    dropin = _dropin(installation)
    as_user("mkdir", "-p", dropin)
    as_user("sh", "-c", f"printf '[Service]\\nWatchdogSec=4\\n' > {dropin}/watchdog.conf")
    systemctl("daemon-reload")
    try:
        systemctl("restart", UNIT)
        pid = int(show(UNIT, "MainPID"))
        restarts = int(show(UNIT, "NRestarts"))
        os.kill(pid, signal.SIGSTOP)
        frozen = time.time()
        wait_for(lambda: int(show(UNIT, "MainPID")) not in (0, pid), 60, "a new main pid")
        assert int(show(UNIT, "NRestarts")) == restarts + 1
        wait_for(lambda: show(UNIT, "ActiveState") == "active", 30, "active again")
        assert _get(configured.url + "/v1/models", configured.inference) == 200
        wait_for(
            lambda: any(
                "watchdog timeout" in line.lower() for line in _manager_lines(installation, frozen)
            ),
            20,
            "the manager's watchdog line",
        )
    finally:
        as_user("rm", "-rf", dropin)
        systemctl("daemon-reload")


def _manager_lines(installation: Installation, since: float) -> list[str]:
    """What the test user's manager said about the unit since `since` (its watchdog timeout)."""
    return [line for line in _journal_lines(f"_UID={installation.uid}", since) if UNIT in line]
