"""The vllm engine's refusals and KV-cache tiers, through the worker against the real dockerd,
with the vLLM stand-in and a test nvidia-smi printing recorded cards (tests/gpu_recordings.py).

A refused start pulls and starts nothing; a running engine is never stopped for a start that
would be refused; the tier directories are owner-only and namespaced, and a change of what makes
old blocks wrong gives a new directory, the old one never mounted again.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.engines.vllm import preflight as pf
from supervisor.engines.vllm.recipe import PLUGIN_BUFFER_BYTES, PLUGIN_QUEUE_BYTES
from tests.docker_witness import DockerWitness
from tests.fixtures import RUN_ID, Engine
from tests.gpu_recordings import fake_nvidia_smi

pytestmark = pytest.mark.docker

NIGHTLY = {"channel": "nightly", "nightly_commit": "e68efc685ab1" + "0" * 28}


def _up(engine: Engine) -> dict[str, Any]:
    engine.start_worker()
    return engine.wait_state(engine.request("running"), "running", timeout=120)


def _reload(engine: Engine) -> None:
    engine.write_recipe()
    engine.procs[-1].send_signal(signal.SIGHUP)


@pytest.fixture
def witness() -> Iterator[DockerWitness]:
    """What the worker asks dockerd, seen on the way (a short path: a socket's is limited).
    Asked for before make_engine, so that it outlives the worker."""
    with (
        tempfile.TemporaryDirectory(prefix="lucia-witness-") as directory,
        DockerWitness(Path(directory)) as seen,
    ):
        yield seen


def _absent(client: docker.DockerClient, engine: Engine, witness: DockerWitness) -> None:
    """Nothing of this engine exists in Docker, and the worker never asked for a pull (no
    registry is reachable here, so a pull would fail and leave no image: the image list would
    say nothing; the API call itself is what shows an attempt)."""
    # the witness is on the worker's way to Docker (its observation may come after the refusal)
    witness.wait("/containers/", 60)
    assert witness.calls("/images/create") == []
    assert client.containers.list(all=True, filters={"name": engine.container}) == []
    assert "pulling" not in engine.log_tail(200)
    assert "engine container started" not in engine.log_tail(200)


@pytest.mark.parametrize(
    ("card", "vllm", "code", "fix"),
    [
        ("h100", NIGHTLY, pf.NIGHTLY_NEEDS_CUDA13, "Use stable, or move the model to a CUDA 13"),
        ("a100", {"quantization": "fp8"}, pf.FP8_UNSUPPORTED, "Use none."),
    ],
)
def test_a_refused_start_is_failed_and_pulls_and_starts_nothing(
    witness: DockerWitness,
    make_engine: Callable[..., Engine],
    client: docker.DockerClient,
    tmp_path: Path,
    card: str,
    vllm: dict[str, str],
    code: str,
    fix: str,
) -> None:
    repository = f"lucia-test-vllm-never-pulled-{RUN_ID}"
    engine = make_engine(
        kind="vllm",
        vllm=vllm,
        vllm_repository=repository,
        nvidia_smi=str(fake_nvidia_smi(tmp_path / "gpu", card)),
        env={"DOCKER_HOST": witness.url},
    )
    engine.start_worker()
    status = engine.wait_state(engine.request("running"), "failed", timeout=60)
    assert status["message"].startswith(f"{code}: ") and fix in status["message"]
    assert status["url"] is None and status["engine"] is None
    _absent(client, engine, witness)


def test_a_host_without_nvidia_smi_is_refused_before_the_pull(
    witness: DockerWitness,
    make_engine: Callable[..., Engine],
    client: docker.DockerClient,
) -> None:
    repository = f"lucia-test-vllm-never-pulled-{RUN_ID}"
    engine = make_engine(
        kind="vllm",
        vllm_repository=repository,
        nvidia_smi="/nonexistent/nvidia-smi",
        env={"DOCKER_HOST": witness.url},
    )
    engine.start_worker()
    status = engine.wait_state(engine.request("running"), "failed", timeout=60)
    assert status["message"].startswith(f"{pf.NO_GPU}: ")
    _absent(client, engine, witness)


def test_a_reload_that_would_be_refused_never_stops_the_running_engine(
    make_engine: Callable[..., Engine],
    client: docker.DockerClient,
) -> None:
    engine = make_engine(kind="vllm")
    status = _up(engine)
    before = client.containers.get(engine.container)
    engine.vllm.update(NIGHTLY)  # this host's driver is CUDA 12.8
    _reload(engine)
    refused = engine.wait_status(lambda s: pf.NIGHTLY_NEEDS_CUDA13 in s["message"], timeout=60)
    assert refused["state"] == "running" and refused["url"] == status["url"], refused
    assert f"failed: {pf.NIGHTLY_NEEDS_CUDA13}: " in refused["message"]
    assert "trying again" not in refused["message"]  # waiting cannot change the driver
    assert engine.file_sd()
    after = client.containers.get(engine.container)
    assert (after.id, after.status, after.attrs["State"]["StartedAt"]) == (
        before.id,
        "running",
        before.attrs["State"]["StartedAt"],
    )
    with urllib.request.urlopen(f"{status['url']}/health", timeout=5) as answer:
        assert answer.status == 200


def _gpu_free(engine: Engine, percent: int) -> None:
    """What the test nvidia-smi reports free on each H100 from now on: `percent` of 81559 MiB
    (as a running vLLM holding its share, and whatever else, leaves it)."""
    query = Path(engine.nvidia_smi).parent / "h100-query.csv"
    header, *rows = query.read_text().splitlines()
    fields = [row.split(", ") for row in rows]
    for row in fields:
        row[3] = str(int(row[2]) * percent // 100)
    query.write_text("\n".join([header, *(", ".join(row) for row in fields)]) + "\n")


def test_the_check_counts_the_replaced_engines_gpu_memory_and_refuses_what_is_held_by_others(
    make_engine: Callable[..., Engine],
    client: docker.DockerClient,
) -> None:
    engine = make_engine(kind="vllm", vllm={"memory": 50})
    _up(engine)
    first = client.containers.get(engine.container)
    _gpu_free(engine, 40)  # ours holds 50 %, something else 10 %
    engine.vllm["memory"] = 60  # 40 % free + our 50 % once it is stopped: it fits
    _reload(engine)
    replaced = engine.wait_status(
        lambda s: (
            s["state"] == "running"
            and (s.get("engine") or {}).get("containerId") not in (None, first.id)
        ),
        timeout=60,
    )
    second = client.containers.get(replaced["engine"]["containerId"])
    args = second.attrs["Args"]
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.60"
    _gpu_free(engine, 30)  # ours holds 60 %, the other 10 %
    engine.vllm["memory"] = 95  # 30 % + 60 % is not 95 %: refused, and ours serves on
    _reload(engine)
    refused = engine.wait_status(lambda s: pf.GPU_MEMORY_BUSY in s["message"], timeout=60)
    assert refused["state"] == "running", refused
    assert f"was refused: {pf.GPU_MEMORY_BUSY}: " in refused["message"]
    assert "trying again in" in refused["message"]  # the other container may let go
    assert engine.file_sd()
    after = client.containers.get(engine.container)
    assert (after.id, after.status, after.attrs["State"]["StartedAt"]) == (
        second.id,
        "running",
        second.attrs["State"]["StartedAt"],
    )
    _gpu_free(engine, 40)  # the other container let go: 40 % + our 60 % fits 95 %
    third = engine.wait_status(
        lambda s: (
            s["state"] == "running"
            and (s.get("engine") or {}).get("containerId") not in (None, second.id)
        ),
        timeout=120,
    )
    args = client.containers.get(third["engine"]["containerId"]).attrs["Args"]
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.95"


# -- tiers -------------------------------------------------------------------------------------


def _tiers(container: Any, engine: Engine) -> tuple[str, dict[str, str]]:
    """The namespace the container mounts, after checking what it mounts and is told."""
    env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
    space = env["LUCIA_KV_NAMESPACE"]
    mounts = {
        m["Destination"]: m["Source"]
        for m in container.attrs["Mounts"]
        if m["Destination"].startswith("/kv/")
    }
    assert mounts == {
        "/kv/nvme": str(engine.root / "kv-nvme" / space),
        "/kv/hdd": str(engine.root / "kv-hdd" / space),
    }
    assert env["LUCIA_KV_NVME_DIR"] == "/kv/nvme" and env["LUCIA_KV_HDD_DIR"] == "/kv/hdd"
    assert env["LUCIA_KV_NVME_BYTES"] == str(1024**3)
    assert env["LUCIA_KV_SHM_DIR"] == f"/dev/shm/lucia-kv/{space}"
    assert env["LUCIA_KV_SHM_BYTES"] == str(16 * 1024**2)
    assert container.attrs["HostConfig"]["ShmSize"] == 64 * 1024**2
    # run.memory (512m) plus the tier plugin's staging buffer and write queue it is told to hold
    buffers = PLUGIN_BUFFER_BYTES + PLUGIN_QUEUE_BYTES
    assert container.attrs["HostConfig"]["Memory"] == 512 * 1024**2 + buffers
    assert int(env["LUCIA_KV_BUFFER_BYTES"]) + int(env["LUCIA_KV_QUEUE_BYTES"]) == buffers
    for tier in ("kv-nvme", "kv-hdd"):
        for path in (engine.root / tier, engine.root / tier / space):
            info = os.stat(path)
            assert stat.S_IMODE(info.st_mode) == 0o700, path
            assert info.st_uid == os.geteuid(), path
    return space, env


def _secrets_are_files(container: Any, files: dict[str, str]) -> None:
    """Each secret is a read-only 0400 file named by its variable; docker inspect (its
    environment, command, arguments, anything) never shows a value."""
    inspected = json.dumps(container.attrs)
    env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
    assert "LUCIA_KV_KEY" not in env and "HF_TOKEN" not in env
    mounts = {m["Destination"]: m for m in container.attrs["Mounts"]}
    for variable, value in files.items():
        assert value not in inspected, f"{variable}'s value is in docker inspect"
        path = env[variable]
        assert mounts[str(Path(path).parent)]["RW"] is False
        code, shown = container.exec_run(["sh", "-c", f'stat -c %a "{path}"; cat "{path}"'])
        assert code == 0 and shown.decode().split() == ["400", value]


def _rotate_key(engine: Engine) -> None:
    (engine.root / "kv.key").write_text(os.urandom(32).hex() + "\n")


CHANGES: dict[str, Callable[[Engine, tuple[str, str]], None]] = {
    "model revision": lambda e, images: setattr(e, "revision", "f" * 40),
    "image digest": lambda e, images: setattr(e, "vllm_repository", images[1]),
    "KV layout": lambda e, images: _set_tiers(e, block_size=32),
    "parallel configuration": lambda e, images: e.vllm.update({"tensor_parallel": 2}),
    "quantization": lambda e, images: e.vllm.update({"quantization": "fp8"}),
    "extra arguments": lambda e, images: e.vllm.update({"args": ["--block-size", "16"]}),
    "cache key": lambda e, images: _rotate_key(e),
}


def _set_tiers(engine: Engine, **tiers: Any) -> None:
    engine.tiers_extra.update(tiers)


def test_tier_directories_are_owner_only_and_each_change_gets_a_new_namespace(
    make_engine: Callable[..., Engine],
    client: docker.DockerClient,
    vllm_images: tuple[str, str],
) -> None:
    engine = make_engine(kind="vllm")
    token = engine.root / "hf-token"
    token.write_text("hf_token_value_" + RUN_ID + "\n")
    token.chmod(0o600)
    engine.secrets["HF_TOKEN"] = str(token)
    _up(engine)
    container = client.containers.get(engine.container)
    space, _ = _tiers(container, engine)
    key = (engine.root / "kv.key").read_text().strip()
    _secrets_are_files(
        container, {"LUCIA_KV_KEY_FILE": key, "HF_TOKEN_PATH": token.read_text().strip()}
    )
    assert key not in (engine.dir / "status.json").read_text() and key not in engine.log_tail(500)
    seen = [space]
    for name, change in CHANGES.items():
        # the plugin's blocks in the NVMe tier: once replaced, the cap needs their room
        (engine.root / "kv-nvme" / space / "block").write_bytes(os.urandom(8192))
        change(engine, vllm_images)
        _reload(engine)
        old = container.id
        status = engine.wait_status(
            lambda s, old=old: (
                s["state"] == "running"
                and (s.get("engine") or {}).get("containerId") not in (None, old)
            ),
            timeout=60,
            what=f"a replacement for the {name}",
        )
        container = client.containers.get(status["engine"]["containerId"])
        space, _ = _tiers(container, engine)
        assert space not in seen, f"a {name} change reused the namespace {space}"
        assert not (engine.root / "kv-nvme" / seen[-1]).exists(), f"{name}: old blocks stayed"
        seen.append(space)
    assert os.listdir(engine.root / "kv-nvme") == [space]
    assert sorted(os.listdir(engine.root / "kv-hdd")) == sorted(seen)  # empty ones: no room


# -- the model download ------------------------------------------------------------------------


def test_the_model_download_is_a_prepare_step_whose_last_output_line_is_the_message(
    make_engine: Callable[..., Engine],
    client: docker.DockerClient,
) -> None:
    """The stand-in image's hf CLI (tests/vllm-standin/python3) draws a progress bar for 8 s;
    the real CLI on the real image: tests/integration/test_vllm_model_download.py."""
    engine = make_engine(
        kind="vllm", settings={"DOWNLOAD_STEPS": "16", "DOWNLOAD_STEP_SECONDS": "0.5"}
    )
    engine.start_worker()
    generation = engine.request("running")
    seen = engine.wait_status(
        lambda s: "model.safetensors:" in s["message"],
        timeout=60,
        what="the download's progress as the message",
    )
    assert seen["state"] == "starting" and seen["generation"] == generation
    assert "\r" not in seen["message"] and seen["message"].count("model.safetensors") == 1
    assert client.containers.list(filters={"name": engine.container}) == []  # not the readiness
    engine.wait_state(generation, "running", timeout=120)
    snapshot = (
        engine.root
        / "hf-cache"
        / "hub"
        / "models--test--tiny-model"
        / "snapshots"
        / engine.revision
    )
    assert (snapshot / "config.json").is_file()
    container = client.containers.get(engine.container)
    env = dict(item.split("=", 1) for item in container.attrs["Config"]["Env"])
    assert env["HF_HUB_OFFLINE"] == "1"  # vLLM loads what the step downloaded


def test_a_failed_download_is_failed_with_its_last_lines_and_starts_nothing(
    make_engine: Callable[..., Engine],
    client: docker.DockerClient,
) -> None:
    engine = make_engine(kind="vllm", settings={"DOWNLOAD_FAIL": "1"})
    engine.start_worker()
    status = engine.wait_state(engine.request("running"), "failed", timeout=60)
    assert status["message"].startswith("download of test/tiny-model (exit 1) failed: ")
    assert "Revision Not Found" in status["message"]
    assert client.containers.list(all=True, filters={"name": engine.container}) == []
    assert client.containers.list(all=True, filters={"label": f"lucia.name={engine.name}"}) == []
