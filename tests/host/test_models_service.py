"""The library's service as its own process, and the CLI beside it: the lease, a kill mid-download
and the restart, the token rules read from the hf child's /proc, add --wait, list."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.host.models import manifest as mf
from tests.gguf_fixtures import write_gguf
from tests.host.library_world import (
    COMMIT,
    GGUF,
    REPO,
    alive,
    cli,
    cli_env,
    hub_of,
    make_repo,
    serve,
    wait_for,
    wait_state,
)
from tests.hub_standin import Hub

TOKEN = "hf_lucia" + "T0kenValue" * 3


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    return make_repo(tmp_path / "repo")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "models"


@pytest.fixture
def hub(repo: Path) -> Iterator[Hub]:
    with hub_of(repo) as running:
        yield running


def _stop(process: subprocess.Popen[str]) -> str:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=60)
    return out


def _added(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout.split()[0]


def test_a_second_library_process_on_the_same_directory_is_refused(root: Path, hub: Hub) -> None:
    env = cli_env(root, hub)
    first = serve(env)
    try:
        wait_for(
            "the lease",
            lambda: (
                (root / ".lucia-model-catalog.lease").is_file()
                and (root / ".lucia-model-catalog.lease").read_text().strip()
            ),
        )
        second = cli("models", "serve", env=env)
        assert second.returncode == 78
        assert f"the model library {root} is already run by pid {first.pid}" in second.stderr
        assert "a second library process would corrupt its catalog" in second.stderr
        assert first.poll() is None
    finally:
        _stop(first)


def test_killed_mid_download_then_restarted_is_interrupted_and_a_retry_finishes_it(
    root: Path, repo: Path, hub: Hub
) -> None:
    write_gguf(repo / GGUF, elements=200_000)
    hub.slow = True
    env = cli_env(root, hub)
    added = cli("models", "add", REPO, "--revision", "main", "--include", GGUF, env=env)
    assert "the library's service is not running: systemctl --user start lucia-models" in (
        added.stderr
    )
    guid = _added(added)
    first = serve(env)
    pid = wait_for("the hf child", lambda: mf.load(root, guid).pid)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    wait_for("the hf child to die with its parent", lambda: not alive(pid))
    assert mf.load(root, guid).state == "Downloading"  # what the killed process left
    second = serve(env)
    try:
        model = wait_state(root, guid, "Interrupted")
        assert model.message == (
            "interrupted: the library's service stopped while it was Downloading; "
            "partial files are kept, retry to continue"
        )
        hub.slow = False
        retried = cli("models", "retry", guid[:8], env=env)
        assert retried.returncode == 0, retried.stderr
        model = wait_state(root, guid, "Ready", "Failed")
        assert model.state == "Ready", model.message
        assert not list((root / guid / "files").rglob("*.incomplete"))
    finally:
        _stop(second)


def test_a_gated_repo_is_refused_without_a_token_and_the_token_is_only_a_file(
    root: Path, repo: Path, hub: Hub, tmp_path: Path
) -> None:
    hub.token = TOKEN
    env = cli_env(root, hub)
    refused = cli("models", "add", REPO, "--revision", "main", "--include", GGUF, env=env)
    assert refused.returncode == 1
    assert "needs a token with access to it (401; no token is set)" in refused.stderr
    assert mf.load_all(root) == []

    token_file = tmp_path / "hf-token"
    token_file.write_text(TOKEN + "\n")
    env = cli_env(
        root,
        hub,
        LUCIA_HF_TOKEN_FILE=str(token_file),
        HF_TOKEN="hf_stray_env_token",
        HUGGING_FACE_HUB_TOKEN="hf_stray_old",
        HF_OIDC_TOKEN="oidc-stray",
    )
    write_gguf(repo / GGUF, elements=200_000)
    guid = _added(cli("models", "add", REPO, "--revision", "main", "--include", GGUF, env=env))
    hub.slow = True
    service = serve(env)
    try:
        pid = wait_for("the hf child", lambda: mf.load(root, guid).pid)
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        environ = dict(
            item.split(b"=", 1)
            for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if b"=" in item
        )
        assert b"download" in argv and COMMIT.encode() in argv and b"--quiet" in argv
        assert not any(TOKEN.encode() in arg for arg in argv)
        assert not any(TOKEN.encode() in value for value in environ.values())
        for name in (b"HF_TOKEN", b"HUGGING_FACE_HUB_TOKEN", b"HF_OIDC_TOKEN"):
            assert name not in environ
        assert environ[b"HF_HUB_DISABLE_UPDATE_CHECK"] == b"1"
        assert b"HF_HUB_DISABLE_IMPLICIT_TOKEN" not in environ
        assert environ[b"HF_HOME"] == str(root / ".hf-home" / "home").encode()
        path = Path(environ[b"HF_TOKEN_PATH"].decode())
        assert path.read_text() == TOKEN
        assert stat.S_IMODE(path.stat().st_mode) == 0o400
        hub.slow = False
        model = wait_state(root, guid, "Ready", "Failed")
        assert model.state == "Ready", model.message
        assert not path.exists()  # the token file lives as long as its download
    finally:
        out = _stop(service)
    assert f"Bearer {TOKEN}" in hub.authorizations
    assert "Bearer hf_stray_env_token" not in hub.authorizations
    assert TOKEN not in out and "download ended" in out
    assert TOKEN not in (root / guid / "model.json").read_text()


def test_add_wait_follows_the_download_and_list_shows_it(root: Path, hub: Hub) -> None:
    env = cli_env(root, hub)
    service = serve(env)
    try:
        added = cli(
            "models",
            "add",
            REPO,
            "--revision",
            COMMIT,
            "--include",
            GGUF,
            "--name",
            "tiny",
            "--wait",
            env=env,
        )
        assert added.returncode == 0, added.stderr
        assert added.stdout.splitlines()[-1] == "tiny: Ready: ready: gguf llama, context 128"
        listed = cli("models", "list", env=env, check=True).stdout.splitlines()
        assert listed[0].split() == ["ID", "NAME", "STATE", "PROGRESS", "MESSAGE"]
        assert listed[1].split()[1:3] == ["tiny", "Ready"]
        shown = json.loads(cli("models", "show", "tiny", env=env, check=True).stdout)
        assert shown["inspection"]["architecture"] == "llama"
        removed = cli("models", "remove", "tiny", env=env)
        assert removed.returncode == 0, removed.stderr
        assert not (root / shown["id"]).exists()
    finally:
        _stop(service)
    assert [name for name in os.listdir(root) if not name.startswith(".")] == []


def test_a_stopped_service_interrupts_its_downloads_and_ends_their_children(
    root: Path, repo: Path, hub: Hub
) -> None:
    write_gguf(repo / GGUF, elements=200_000)
    hub.slow = True
    env = cli_env(root, hub)
    service = serve(env)
    try:
        guid = _added(cli("models", "add", REPO, "--revision", "main", "--include", GGUF, env=env))
        pid = wait_for("the hf child", lambda: mf.load(root, guid).pid)
    finally:
        out = _stop(service)
    assert service.returncode == 0, out
    model = mf.load(root, guid)
    assert model.state == "Interrupted"
    assert model.message == (
        "interrupted: the library's service stopped; partial files are kept, retry to continue"
    )
    assert not alive(pid)
