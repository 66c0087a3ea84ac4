"""The lucia-gateway systemd user unit as install.sh installs it, under lucia's real user manager:
installed stopped and not enabled; with a settings file and the two key files in lucia's
~/.config/lucia it is active only once it listens (Type=notify, READY after the bind), its
journal has the start line and never a key, and a frozen gateway is restarted by the watchdog.

The cases run in order against the session's installation; the module removes what it wrote.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.standin import free_port
from tests.system.harness import Installation, as_user, show, systemctl, wait_for

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
    """A file of lucia's, 0600, its content through stdin (a key never in an argument list)."""
    as_user(
        "sh",
        "-c",
        f'umask 077 && mkdir -p "$(dirname {path})" && cat > {path}.tmp && mv {path}.tmp {path}',
        input=text,
    )


def _journal(since: float) -> list[str]:
    """The gateway's lines since `since`, by its SyslogIdentifier."""
    result = subprocess.run(
        [
            "journalctl",
            "-t",
            "lucia-gateway",
            "--no-pager",
            "-o",
            "cat",
            "--since",
            f"@{int(since) - 1}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in result.stdout.splitlines() if line.strip()]


def _get(url: str, key: str | None = None) -> int:
    request = urllib.request.Request(url)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as error:
        return error.code


def _dropin(installation: Installation) -> str:
    return str(installation.home / ".config/systemd/user" / f"{UNIT}.d")


@pytest.fixture(scope="module")
def configured(installation: Installation) -> Iterator[Configured]:
    """gateway.toml on a free port and the two key files, in lucia's ~/.config/lucia."""
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
    """What lucia's user manager said about the unit since `since` (its watchdog timeout)."""
    result = subprocess.run(
        [
            "journalctl",
            f"_UID={installation.uid}",
            "--no-pager",
            "-o",
            "cat",
            "--since",
            f"@{int(since) - 1}",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in result.stdout.splitlines() if UNIT in line]
