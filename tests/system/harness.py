"""Fixtures under the real systemd user manager of the tests' own service user, with journald
and dockerd.

The tests run as `lucia-test` (LUCIA_TEST_USER overrides), never as the operator's `lucia`: an
operator runs them on a machine whose demo or engines serve as `lucia`, and they must leave its
units, data, containers and ports as they found them. scripts/machine.sh makes both users and
starts each one's user manager (as .ci/run does); these fixtures install the project with
install.sh as the test user, exactly as an operator would, and drive it with systemctl and the
CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.fixtures import DEFAULT_MACHINE
from tests.standin import busybox_image, demo_recipe, free_port, recipe_repository

ROOT = Path(__file__).resolve().parents[2]
AS_USER = ROOT / "scripts" / "as-lucia"
OPERATOR_USER = "lucia"  # install.sh's and the demo's user: the tests never act as it
USER = os.environ.get("LUCIA_TEST_USER") or "lucia-test"
RUN_ID = uuid.uuid4().hex[:6]
if USER == OPERATOR_USER:
    raise RuntimeError(f"LUCIA_TEST_USER={USER}: the tests never run as the operator's user")


def as_user(
    *args: str, check: bool = True, timeout: float = 300, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    """args run as the test user (scripts/as-lucia with LUCIA_USER set to it)."""
    result = subprocess.run(
        [str(AS_USER), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        input=input,
        env={**os.environ, "LUCIA_USER": USER},
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def systemctl(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return as_user("systemctl", "--user", *args, check=check)


def show(unit: str, prop: str) -> str:
    return systemctl("show", unit, "-p", prop, "--value").stdout.strip()


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


@dataclass(frozen=True)
class Installation:
    name: str
    home: Path
    uid: int
    recipe: Path
    port: int
    network: str
    image_tag: str
    source: Path
    install_output: str

    @property
    def unit(self) -> str:
        return f"lucia-{self.name}.service"

    @property
    def share(self) -> Path:
        return self.home / ".local/share/lucia"

    @property
    def data_dir(self) -> Path:
        return self.share / "host/data"

    @property
    def engine_dir(self) -> Path:
        return self.data_dir / self.name

    @property
    def cli(self) -> str:
        return str(self.share / "venv/bin/lucia-supervisor")

    @property
    def container(self) -> str:
        return f"lucia-{self.name}"

    def status(self) -> dict[str, Any] | None:
        try:
            return dict(json.loads((self.engine_dir / "status.json").read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def request(self, desired: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return as_user(self.cli, "request", self.name, desired, *extra)

    def main_pid(self) -> int:
        return int(show(self.unit, "MainPID"))


def copy_project(source: Path) -> Path:
    """The project as a user would have it: a copy of the tracked (and new) files."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for rel in filter(None, files):
        path = Path(rel.decode())
        if (ROOT / path).is_file():
            (source / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, source / path)
    return source


def prometheus_api(base: str, path: str, raw: bool = False) -> Any:
    """A Prometheus API answer's data (or the raw body); None while it does not answer."""
    try:
        with urllib.request.urlopen(base + path, timeout=5) as response:
            body = response.read().decode()
    except OSError:
        return None
    return body if raw else json.loads(body)["data"]


def prometheus_targets(base: str, name: str) -> list[dict[str, Any]]:
    """The active targets Prometheus discovered for the engine `name` (its file_sd label)."""
    data = prometheus_api(base, "/api/v1/targets?state=active") or {"activeTargets": []}
    return [t for t in data["activeTargets"] if t["labels"].get("name") == name]


def prometheus_query(base: str, expr: str) -> dict[str, str]:
    """model -> value of an instant query."""
    data = prometheus_api(base, "/api/v1/query?query=" + urllib.parse.quote(expr)) or {"result": []}
    return {r["metric"].get("model", ""): r["value"][1] for r in data["result"]}


@contextlib.contextmanager
def running_prometheus(telemetry: Path, work: Path, workers: Sequence[str] = ()) -> Iterator[str]:
    """Debian's real Prometheus on loopback, discovering the file_sd files in `telemetry`
    every second (and scraping the workers' own metrics at `workers`, host:port, as the job
    `lucia-worker`); yields its URL once it is ready."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("Debian's prometheus package is needed (scripts/machine.sh installs it)")
    port = free_port()
    config = work / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: lucia\n    file_sd_configs:\n"
        f"      - files: ['{telemetry}/*.json']\n"
        "        refresh_interval: 1s\n"
        + (
            "  - job_name: lucia-worker\n    static_configs:\n"
            f"      - targets: {json.dumps(list(workers))}\n"
            if workers
            else ""
        )
    )
    log = (work / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: prometheus_api(url, "/-/ready", raw=True), 60, "prometheus to be ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


@contextlib.contextmanager
def machine_settings(home: Path) -> Iterator[Path]:
    """The test user's ~/.config/lucia/machine.toml, written as that user (0600) for the body of
    the `with` and removed after it; one it had before is put back. It holds the settings every
    worker the tests start gets (DEFAULT_MACHINE: the host's memory, a small reserve), not the
    default reserves (18 GiB), which leave this machine less than an engine beside a demo.
    The one it had before is put back even where a purge removed ~/.config/lucia."""
    path = home / ".config/lucia/machine.toml"
    before = path.read_text() if path.exists() else None
    as_user(
        "sh",
        "-c",
        'umask 077 && mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1"',
        "machine-settings",
        str(path),
        input=DEFAULT_MACHINE,
    )
    try:
        yield path
    finally:
        if before is None:
            as_user("rm", "-f", str(path), check=False)
        else:
            as_user(
                "sh",
                "-c",
                'umask 077 && mkdir -p "$(dirname "$1")" && cat > "$1.tmp" && mv "$1.tmp" "$1"',
                "machine-settings",
                str(path),
                input=before,
                check=False,
            )


@pytest.fixture(scope="session")
def user_manager() -> pwd.struct_passwd:
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        pytest.fail(f"no user {USER}: scripts/machine.sh sets up the systemd user manager")
    state = systemctl("is-system-running", check=False).stdout.strip()
    if state not in ("running", "degraded"):
        pytest.fail(
            f"the systemd user manager of {USER} is not running ({state!r}); run scripts/machine.sh"
        )
    return entry


@pytest.fixture(scope="session")
def docker_client() -> Iterator[docker.DockerClient]:
    client = docker.from_env(timeout=120)
    client.ping()
    yield client
    client.close()


@pytest.fixture(scope="session")
def installation(
    user_manager: pwd.struct_passwd,
    docker_client: docker.DockerClient,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Installation]:
    home = Path(user_manager.pw_dir)
    uid, gid = user_manager.pw_uid, user_manager.pw_gid
    work = home / f"lucia-system-test-{RUN_ID}"
    if work.exists():
        shutil.rmtree(work)
    source = copy_project(work / "src")
    # the stand-in recipe repository and its base image
    base = busybox_image(
        docker_client,
        tmp_path_factory.mktemp("base") / "context",
        f"lucia-systest-busybox-{RUN_ID}:1",
    )
    repo = work / "recipe-repo"
    commit = recipe_repository(repo)
    name = f"sys{RUN_ID}"
    port = free_port()
    network = f"lucia-systest-{RUN_ID}"
    image_tag = f"lucia-systest-recipe-{RUN_ID}:v1"
    recipe = work / f"{name}.toml"
    recipe.write_text(
        demo_recipe(
            name, repo, commit, image_tag, base, port, network, run={"metrics_path": "/metrics"}
        )
    )
    subprocess.run(["chown", "-R", f"{uid}:{gid}", str(work)], check=True)
    install = as_user(str(source / "install.sh"), "--recipe", str(recipe), timeout=900)
    installed = Installation(
        name, home, uid, recipe, port, network, image_tag, source, install.stdout + install.stderr
    )
    with machine_settings(home):
        yield installed
        systemctl("stop", installed.unit, check=False)
    with contextlib.suppress(docker.errors.NotFound):
        docker_client.containers.get(installed.container).remove(force=True)
    as_user(str(source / "install.sh"), "--uninstall", check=False)
    for tag in (image_tag + "-grammar", image_tag, base):
        with contextlib.suppress(docker.errors.ImageNotFound):
            docker_client.images.remove(tag, force=True)
    with contextlib.suppress(docker.errors.NotFound):
        docker_client.networks.get(network).remove()
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(installed.data_dir / name, ignore_errors=True)
