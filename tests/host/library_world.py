"""A model library, a hub of the test's own holding a tiny GGUF repo, and the queue to run it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from supervisor.host.models import manifest as mf
from supervisor.host.models.control import add
from supervisor.host.models.hub import Hub as HubClient
from supervisor.host.models.job import QueueSettings
from supervisor.host.models.runner import Runner
from tests.gguf_fixtures import write_gguf
from tests.hub_standin import Hub

ROOT = Path(__file__).resolve().parents[2]
REPO = "lucia-test/tiny-GGUF"
COMMIT = "5" * 40
GGUF = "tiny-Q4_K_M.gguf"
WAIT = 120.0


def make_repo(directory: Path, *, elements: int = 16) -> Path:
    """A repo with one GGUF (llama, context 128), a README and a second quantisation."""
    write_gguf(directory / GGUF, elements=elements)
    write_gguf(directory / "tiny-Q8_0.gguf", elements=elements)
    (directory / "README.md").write_text("a tiny model\n")
    return directory


def wait_for(what: str, check: Callable[[], Any], timeout: float = WAIT) -> Any:
    """Poll check until it returns something true; fail naming what never happened."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.1)


def state_of(root: Path, guid: str) -> mf.ModelManifest:
    return mf.load(root, guid)


def wait_state(root: Path, guid: str, *states: str) -> mf.ModelManifest:
    model: mf.ModelManifest = wait_for(
        f"{guid} in {states}",
        lambda: (m := state_of(root, guid)).state in states and m,
    )
    return model


def queue(
    root: Path,
    hub: Hub,
    *,
    include: list[str] | None = None,
    token: str | None = None,
    revision: str = "main",
) -> mf.ModelManifest:
    client = HubClient(hub.url, token)
    return add(root, client, REPO, revision, include=include or [GGUF], name=None)


@contextmanager
def running(root: Path, **settings: Any) -> Iterator[Runner]:
    """The queue in a thread of this process; stopped (downloads Interrupted) on exit."""
    runner = Runner(root, QueueSettings(poll=0.1, **settings))
    runner.start()
    stop = threading.Event()
    thread = threading.Thread(target=runner.run, args=(stop,), daemon=True)
    thread.start()
    try:
        yield runner
    finally:
        stop.set()
        thread.join(30)


def cli(*args: str, env: dict[str, str], check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "supervisor.cli", *args],
        env=env,
        cwd=ROOT,
        text=True,
        capture_output=True,
        timeout=WAIT,
        check=check,
    )


def cli_env(root: Path, hub: Hub, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(
        PYTHONPATH=str(ROOT),
        LUCIA_MODELS_DIR=str(root),
        HF_ENDPOINT=hub.url,
        LUCIA_HF_TOKEN_FILE=str(root.parent / "no-token"),
    )
    env.update(extra)
    return env


def serve(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "supervisor.cli", "models", "serve", *args],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def hub_of(repo: Path, **faults: object) -> Hub:
    """The tests' hub serving `repo` as REPO at COMMIT, with the branch main on it."""
    return Hub(REPO, COMMIT, repo, "127.0.0.1", branches={"main": COMMIT}, **faults)  # type: ignore[arg-type]


def add_served(root: Path, hub: Hub, *args: str) -> subprocess.CompletedProcess[str]:
    """`models add REPO --revision main ARGS --wait` while the library's service runs (stopped
    after)."""
    env = cli_env(root, hub)
    service = serve(env)
    try:
        return cli("models", "add", REPO, "--revision", "main", *args, "--wait", env=env)
    finally:
        service.send_signal(signal.SIGTERM)
        service.communicate(timeout=60)


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie counts as ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status
