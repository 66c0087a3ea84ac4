"""The lucia-models systemd user unit as install.sh installs it, under the test user's real user
manager: installed stopped and not enabled; started, it is active once the queue holds the
library's lease (Type=notify), its journal has the start line; a second queue on the same library
is refused; stopped, it releases the lease."""

from __future__ import annotations

import pwd
import subprocess
import time

import pytest

from tests.system.harness import USER, Installation, as_user, show, systemctl, wait_for

pytestmark = pytest.mark.system

UNIT = "lucia-models.service"


def _journal(since: float) -> list[str]:
    """The test user's lucia-models lines (an operator's may log beside them)."""
    result = subprocess.run(
        [
            "journalctl",
            "-t",
            "lucia-models",
            f"_UID={pwd.getpwnam(USER).pw_uid}",
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


def test_installed_stopped_then_started_it_holds_the_lease(installation: Installation) -> None:
    unit_file = installation.home / ".config/systemd/user" / UNIT
    assert unit_file.is_file()
    assert show(UNIT, "ActiveState") == "inactive"
    assert systemctl("is-enabled", UNIT, check=False).stdout.strip() == "disabled"
    verify = as_user("systemd-analyze", "--user", "verify", str(unit_file), check=False)
    assert verify.returncode == 0, verify.stderr
    library = installation.home / ".local/share/lucia/models"
    cli = str(installation.home / ".local/share/lucia/venv/bin/lucia-supervisor")
    started = time.time()
    try:
        systemctl("start", UNIT)  # returns once READY=1 came: the lease is held by then
        assert show(UNIT, "ActiveState") == "active"
        pid = int(show(UNIT, "MainPID"))
        assert (library / ".lucia-model-catalog.lease").read_text().strip() == str(pid)
        wait_for(
            lambda: any("model library running" in line for line in _journal(started)),
            20,
            "the start line",
        )
        second = as_user("env", f"LUCIA_MODELS_DIR={library}", cli, "models", "serve", check=False)
        assert second.returncode == 78
        assert f"is already run by pid {pid}" in second.stderr
        assert as_user(cli, "models", "list").stdout.split() == [
            "ID",
            "NAME",
            "STATE",
            "PROGRESS",
            "MESSAGE",
        ]
    finally:
        systemctl("stop", UNIT, check=False)
        systemctl("reset-failed", UNIT, check=False)
    assert show(UNIT, "ActiveState") == "inactive"
    assert (library / ".lucia-model-catalog.lease").read_text() == ""
