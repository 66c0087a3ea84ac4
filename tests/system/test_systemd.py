"""The product as operators meet it: systemctl --user, journalctl and the CLI, all real.

The tests run in order against one installation (installing takes a while): each leaves the
unit and the engine in the state the next one starts from. The last ones uninstall it, then purge
its data.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import docker
import pytest

from supervisor.host.protocol import classify
from supervisor.protocol.documents import parse_status
from tests.system.harness import (
    RUN_ID,
    Installation,
    as_user,
    running_prometheus,
    show,
    systemctl,
    wait_for,
)
from tests.system.harness import prometheus_api as _api
from tests.system.harness import prometheus_targets as _targets

pytestmark = pytest.mark.system


def _fresh(installed: Installation, after: float) -> dict | None:
    status = installed.status()
    if status is None:
        return None
    checked = datetime.fromisoformat(status["checkedAt"].replace("Z", "+00:00")).timestamp()
    return status if checked > after else None


def _running(installed: Installation, generation: int, after: float = 0.0) -> dict | None:
    status = _fresh(installed, after)
    if status and status["generation"] == generation and status["state"] == "running":
        return status
    return None


def _engine(client: docker.DockerClient, installed: Installation) -> dict:
    return client.containers.get(installed.container).attrs


def test_installed_inactive_disabled_and_valid(installation: Installation) -> None:
    unit_file = installation.home / ".config/systemd/user" / installation.unit
    assert unit_file.is_file()
    assert show(installation.unit, "ActiveState") == "inactive"
    assert systemctl("is-enabled", installation.unit, check=False).stdout.strip() == "disabled"
    assert show(installation.unit, "Type") == "notify"
    assert show(installation.unit, "NotifyAccess") == "main"
    assert show(installation.unit, "Restart") == "on-failure"
    assert "WatchdogSec=30" in systemctl("cat", installation.unit).stdout
    verify = as_user("systemd-analyze", "--user", "verify", str(unit_file), check=False)
    assert verify.returncode == 0, verify.stderr
    assert (installation.data_dir.stat().st_mode & 0o777) == 0o750
    state = installation.home / ".local/state/lucia"
    assert (state.stat().st_mode & 0o777) == 0o700
    # the documentation beside the README: the source's docs/ tree, files 0644, folders 0755
    docs, installed_docs = installation.source / "docs", installation.share / "docs"
    assert any(docs.iterdir()), "the project's docs/ is the tree install.sh installs"
    tree = {path.relative_to(docs) for path in docs.rglob("*")}
    assert {path.relative_to(installed_docs) for path in installed_docs.rglob("*")} == tree
    for relative in tree:
        source, copy = docs / relative, installed_docs / relative
        assert (copy.stat().st_mode & 0o777) == (0o755 if source.is_dir() else 0o644), copy
        assert source.is_dir() or copy.read_bytes() == source.read_bytes()


def test_a_second_install_changes_nothing(installation: Installation) -> None:
    unit_file = installation.home / ".config/systemd/user" / installation.unit
    before = unit_file.stat().st_mtime_ns
    again = as_user(
        str(installation.source / "install.sh"), "--recipe", str(installation.recipe), timeout=300
    )
    assert "nothing to change" in again.stdout, again.stdout + again.stderr
    assert unit_file.stat().st_mtime_ns == before


def test_install_refuses_root_with_the_fix(installation: Installation) -> None:
    result = subprocess.run(
        ["bash", str(installation.source / "install.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "not as root" in result.stderr


def test_start_is_active_only_after_ready(installation: Installation) -> None:
    systemctl("start", installation.unit)  # blocks until READY=1 for Type=notify
    assert show(installation.unit, "ActiveState") == "active"
    status = installation.status()
    assert status is not None, "READY=1 came before the first status.json"
    assert show(installation.unit, "StatusText")
    assert show(installation.unit, "WatchdogUSec") == "30s"


def test_request_running_brings_the_engine_up(installation: Installation) -> None:
    out = installation.request("running", "--wait", "--timeout", "240")
    generation = int(out.stdout.splitlines()[0])
    status = installation.status()
    assert status and status["generation"] == generation and status["state"] == "running"
    assert "running" in show(installation.unit, "StatusText")
    # the installed worker, as the test user, plans at every look and publishes it: the
    # machine's settings from the test user's own config, the host's MemTotal, the running
    # engines from dockerd
    planned = wait_for(lambda: (installation.status() or {}).get("memory"), 60, "a memory plan")
    with open("/proc/meminfo", encoding="ascii") as meminfo:
        total = next(int(n.split()[1]) * 1024 for n in meminfo if n.startswith("MemTotal:"))
    assert (planned["limitSource"], planned["limit"]) == ("host", total), planned
    assert set(planned["reserves"]) == {"os", "services", "voice", "runtime"}, planned


def test_restart_leaves_the_engine_untouched(
    installation: Installation, docker_client: docker.DockerClient
) -> None:
    before = _engine(docker_client, installation)
    generation = installation.status()["generation"]  # type: ignore[index]
    restarted = time.time()
    systemctl("restart", installation.unit)
    wait_for(lambda: _running(installation, generation, restarted), 10, "current status")
    after = _engine(docker_client, installation)
    assert after["Id"] == before["Id"]
    assert after["State"]["StartedAt"] == before["State"]["StartedAt"]


def _watchdog_dropin(installation: Installation, seconds: int) -> None:
    dropin = installation.home / ".config/systemd/user" / f"{installation.unit}.d"
    as_user("mkdir", "-p", str(dropin))
    as_user("sh", "-c", f"printf '[Service]\\nWatchdogSec={seconds}\\n' > {dropin}/watchdog.conf")
    systemctl("daemon-reload")


def test_a_hung_worker_is_restarted_by_the_watchdog(
    installation: Installation, docker_client: docker.DockerClient
) -> None:
    _watchdog_dropin(installation, 4)
    try:
        systemctl("restart", installation.unit)
        before = _engine(docker_client, installation)
        generation = installation.status()["generation"]  # type: ignore[index]
        pid = installation.main_pid()
        restarts = int(show(installation.unit, "NRestarts"))
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.time()
        wait_for(lambda: installation.main_pid() not in (0, pid), 40, "a new main pid")
        assert int(show(installation.unit, "NRestarts")) == restarts + 1
        wait_for(lambda: _running(installation, generation, stopped_at), 20, "adoption")
        after = _engine(docker_client, installation)
        assert after["Id"] == before["Id"]
        assert after["State"]["StartedAt"] == before["State"]["StartedAt"]
    finally:
        as_user(
            "rm", "-rf", str(installation.home / ".config/systemd/user" / f"{installation.unit}.d")
        )
        systemctl("daemon-reload")


def test_a_killed_worker_is_restarted(
    installation: Installation, docker_client: docker.DockerClient
) -> None:
    systemctl("restart", installation.unit)
    before = _engine(docker_client, installation)
    generation = installation.status()["generation"]  # type: ignore[index]
    pid = installation.main_pid()
    restarts = int(show(installation.unit, "NRestarts"))
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    wait_for(lambda: installation.main_pid() not in (0, pid), 20, "a new main pid")
    assert int(show(installation.unit, "NRestarts")) == restarts + 1
    wait_for(lambda: _running(installation, generation, killed_at), 20, "adoption")
    after = _engine(docker_client, installation)
    assert (after["Id"], after["State"]["StartedAt"]) == (
        before["Id"],
        before["State"]["StartedAt"],
    )


def _journal(installation: Installation, *extra: str) -> list[str]:
    """The worker's lines, by its SyslogIdentifier (reliable for root, unlike --user-unit,
    which matches the caller's own uid)."""
    result = subprocess.run(
        ["journalctl", "-t", f"lucia-{installation.name}", "--no-pager", "-o", "cat", *extra],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in result.stdout.splitlines() if line.strip()]


def _write_as_user(path: str, text: str) -> None:
    """Replace a file atomically as the user would (temp file, then rename)."""
    as_user("sh", "-c", f"cat > {path}.tmp && mv {path}.tmp {path}", input=text)


def _journal_json(installation: Installation) -> list[dict]:
    result = subprocess.run(
        ["journalctl", "-t", f"lucia-{installation.name}", "--no-pager", "-o", "json", "-n", "500"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_the_journal_has_one_line_per_event_with_its_priority(
    installation: Installation,
) -> None:
    desired = str(installation.engine_dir / "desired.json")
    good = (installation.engine_dir / "desired.json").read_text()
    _write_as_user(desired, '{"desired": "paused"}')
    wait_for(lambda: (installation.status() or {}).get("refused"), 10, "a refusal")
    _write_as_user(desired, good)
    wait_for(lambda: (installation.status() or {}).get("refused") is None, 10, "no refusal")

    def refused_entries() -> list[dict]:
        return [
            e
            for e in _journal_json(installation)
            if str(e.get("MESSAGE", "")).startswith("desired.json refused")
        ]

    (entry, *_) = wait_for(refused_entries, 10, "the refusal in the journal")
    assert entry["PRIORITY"] == "4"
    assert "paused" in entry["MESSAGE"] or "schemaVersion" in entry["MESSAGE"]
    entries = _journal_json(installation)
    acknowledged = [
        e for e in entries if str(e.get("MESSAGE", "")).startswith("request acknowledged")
    ]
    assert acknowledged and all(e["PRIORITY"] == "6" for e in acknowledged)
    assert all(not str(e.get("MESSAGE", "")).startswith("<") for e in entries)

    filtered = _journal(installation, "-p", "warning")
    assert any(line.startswith("desired.json refused") for line in filtered)
    assert not any(line.startswith("request acknowledged") for line in filtered)


@pytest.fixture
def prometheus(installation: Installation, tmp_path) -> Iterator[str]:
    with running_prometheus(installation.data_dir / "telemetry", tmp_path) as url:
        yield url


def test_prometheus_discovers_scrapes_and_drops_the_engine(
    installation: Installation, prometheus: str, docker_client: docker.DockerClient
) -> None:
    installation.request("running", "--wait", "--timeout", "120")  # whatever ran before
    (target,) = wait_for(
        lambda: [t for t in _targets(prometheus, installation.name) if t["health"] == "up"],
        60,
        "the engine target up",
    )
    gateway = docker_client.networks.get(installation.network).attrs["IPAM"]["Config"][0]["Gateway"]
    assert target["discoveredLabels"]["__address__"] == f"{gateway}:{installation.port}"
    assert target["labels"]["engine"] == "tensorfold"
    assert target["scrapeUrl"].endswith("/metrics")
    query = urllib.parse.quote(f'up{{name="{installation.name}"}}')
    result = wait_for(
        lambda: (_api(prometheus, f"/api/v1/query?query={query}") or {"result": []})["result"],
        30,
        "an up sample",
    )  # type: ignore[index]
    assert result[0]["value"][1] == "1"

    installation.request("stopped", "--wait", "--timeout", "120")
    wait_for(lambda: not _targets(prometheus, installation.name), 30, "the target dropped")
    installation.request("running", "--wait", "--timeout", "120")


def test_stop_leaves_the_engine_running_and_the_status_goes_stale(
    installation: Installation, docker_client: docker.DockerClient
) -> None:
    before = _engine(docker_client, installation)
    systemctl("stop", installation.unit)
    assert show(installation.unit, "ActiveState") in ("inactive", "failed")
    after = _engine(docker_client, installation)
    assert after["State"]["Running"] and after["Id"] == before["Id"]
    status = parse_status((installation.engine_dir / "status.json").read_text())
    now = datetime.now(UTC)
    assert classify(status, status.generation, now).answer == "current"
    later = classify(status, status.generation, now + timedelta(seconds=61))
    assert later.answer == "unavailable"
    result = as_user(installation.cli, "status", installation.name, "--json")
    assert json.loads(result.stdout)[0]["answer"] == "current"  # still fresh right now
    systemctl("start", installation.unit)


# -- uninstall and purge: last, since they remove what the tests above used ---------------------


def _install_sh(installation: Installation, *args: str) -> subprocess.CompletedProcess[str]:
    return as_user(str(installation.source / "install.sh"), *args, check=False)


def _units_dir(installation: Installation) -> Path:
    return installation.home / ".config/systemd/user"


def _lucia_units(installation: Installation) -> list[str]:
    return sorted(path.name for path in _units_dir(installation).glob("lucia-*.service"))


def _state(installation: Installation) -> Path:
    return installation.home / ".local/state/lucia"


def _config(installation: Installation) -> Path:
    return installation.home / ".config/lucia"


def _dropin(installation: Installation) -> Path:
    return _units_dir(installation) / f"{installation.unit}.d" / "local.conf"


def test_purge_is_refused_while_an_engine_container_of_the_installation_exists(
    installation: Installation, docker_client: docker.DockerClient
) -> None:
    """Before anything is removed, units included: the data holds what the engine mounts. The
    engine's container names its installation's data directory, which is how it is known."""
    installation.request("running", "--wait", "--timeout", "120")
    engine = _engine(docker_client, installation)
    assert engine["Config"]["Labels"]["lucia.data"] == str(installation.data_dir)
    units = _lucia_units(installation)
    assert {installation.unit, "lucia-gateway.service", "lucia-models.service"} <= set(units)
    refused = _install_sh(installation, "--uninstall", "--purge")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "nothing removed" in refused.stderr
    assert f"{installation.container} (engine {installation.name})" in refused.stderr
    assert f"{installation.cli} request {installation.name} stopped --wait" in refused.stderr
    assert not refused.stdout  # it says nothing was done, and did nothing
    assert _lucia_units(installation) == units
    assert show(installation.unit, "ActiveState") == "active"
    for kept in (
        Path(installation.cli),
        installation.share / "recipes" / f"{installation.name}.toml",
        installation.share / "README.md",
        installation.share / "docs",
        installation.engine_dir / "status.json",
        _state(installation),
        _config(installation) / "machine.toml",
    ):
        assert kept.exists(), kept
    after = _engine(docker_client, installation)
    assert (after["Id"], after["State"]["Running"]) == (engine["Id"], True)


def test_uninstall_removes_units_and_environment_and_keeps_the_data(
    installation: Installation, docker_client: docker.DockerClient
) -> None:
    """Every lucia unit stopped, disabled and removed, systemd reloaded; the venv, recipes and
    documentation removed; the data, its settings and the units' drop-ins kept, and the output
    says where they are and what purges them. A second uninstall finds nothing to remove."""
    installation.request("stopped", "--wait", "--timeout", "120")
    with pytest.raises(docker.errors.NotFound):  # a stopped engine's worker removes its container
        docker_client.containers.get(installation.container)
    as_user("mkdir", "-p", str(_dropin(installation).parent))
    as_user(
        "sh",
        "-c",
        'printf "[Service]\\nEnvironment=X=1\\n" > "$1"',
        "dropin",
        str(_dropin(installation)),
    )
    systemctl("enable", installation.unit)
    wants = _units_dir(installation) / "default.target.wants"
    assert (wants / installation.unit).is_symlink()
    status_before = (installation.engine_dir / "status.json").read_text()
    result = _install_sh(installation, "--uninstall")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"stopped, disabled and removed {installation.unit}" in result.stdout
    assert "kept the data" in result.stdout
    for kept in (installation.share, _state(installation), _config(installation)):
        assert str(kept) in result.stdout
    assert "no engine container of this installation exists" in result.stdout
    assert f"{installation.source}/install.sh --uninstall --purge" in result.stdout
    assert not _lucia_units(installation)
    assert not list(wants.glob("lucia-*"))
    for unit in (installation.unit, "lucia-gateway.service", "lucia-models.service"):
        assert show(unit, "LoadState") == "not-found", unit
        assert systemctl("is-active", unit, check=False).stdout.strip() != "active"
    for gone in ("venv", "recipes", "README.md", "docs"):
        assert not (installation.share / gone).exists(), gone
    assert (installation.engine_dir / "status.json").read_text() == status_before
    assert _state(installation).is_dir()
    assert (_config(installation) / "machine.toml").is_file()
    assert _dropin(installation).is_file()
    again = _install_sh(installation, "--uninstall")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "nothing to remove" in again.stdout


def test_purge_removes_the_data_and_nothing_it_did_not_make(
    installation: Installation, docker_client: docker.DockerClient
) -> None:
    """With no engine container of the installation left, the data goes too: the share, the state
    and ~/.config/lucia, and the units' drop-ins. Another installation's container, even one with
    an engine's name, and files beside the data stay. An unlabelled container with one of its
    engines' names (made before containers named their installation) is taken for its own."""
    home = installation.home
    markers = [
        home / ".local/share" / f"lucia-systest-marker-{RUN_ID}",
        home / ".local/state" / f"lucia-systest-marker-{RUN_ID}",
        home / ".config" / f"lucia-systest-marker-{RUN_ID}",
    ]
    for marker in markers:
        as_user("sh", "-c", 'echo marker > "$1"', "marker", str(marker))
    engine = {"lucia.managed": "true", "lucia.name": installation.name}
    elsewhere = "/home/another-user/.local/share/lucia/host/data"
    other = docker_client.containers.create(
        installation.image_tag,
        ["true"],
        name=f"lucia-systest-other-{RUN_ID}",
        labels={**engine, "lucia.data": elsewhere},
    )
    unlabelled = docker_client.containers.create(
        installation.image_tag, ["true"], name=f"lucia-systest-unlabelled-{RUN_ID}", labels=engine
    )
    try:
        refused = _install_sh(installation, "--uninstall", "--purge")
        assert refused.returncode == 1, refused.stdout + refused.stderr
        assert f"{unlabelled.name} (engine {installation.name}; unlabelled" in refused.stderr
        assert f"docker stop {unlabelled.name} && docker rm {unlabelled.name}" in refused.stderr
        assert other.name not in refused.stderr
        assert installation.data_dir.is_dir() and _config(installation).is_dir()
        unlabelled.remove()

        purged = _install_sh(installation, "--uninstall", "--purge")
        assert purged.returncode == 0, purged.stdout + purged.stderr
        for gone in (installation.share, _state(installation), _config(installation)):
            assert f"removed {gone}" in purged.stdout
            assert not gone.exists(), gone
        assert not _dropin(installation).parent.exists()
        assert all(marker.read_text() == "marker\n" for marker in markers)
        assert docker_client.containers.get(other.id).labels["lucia.data"] == elsewhere
        again = _install_sh(installation, "--uninstall", "--purge")
        assert again.returncode == 0, again.stdout + again.stderr
        assert "nothing to remove" in again.stdout
    finally:
        for marker in markers:
            as_user("rm", "-f", str(marker), check=False)
        for container in (other, unlabelled):
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)
