"""The shipped Spark recipe on a repository with the real recipe's layout (tests/tensorfold-recipe):
prepare.sh makes the image, the grammar image is built on it, and the engine is served with
start.sh's arguments; its own parser checks a replacement first; its token is set deliberately."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.docker import labels
from tests.fixtures import Engine, RecipeRepo, http_text, shipped_recipe

pytestmark = pytest.mark.docker

MODEL_ID = "local-inference-lab/Qwen3.8-Flash-Next-NVFP4"
IMAGE = "tensorfold-qwen38:v0.6.6"  # the shipped tag, unchanged
SERVE_ARGS = [
    "serve",
    MODEL_ID,
    "--host",
    "0.0.0.0",
    "--port",
    "8888",
    "--name",
    "Qwen3.8-Flash-Next",
    "--parallel",
    "4",
    "--context",
    "200000",
    "--kv-dtype",
    "int8",
    "--mtp-drafts",
    "6",
    "--mtp-confidence",
    "0.60",
    "--temperature",
    "1.0",
    "--top-p",
    "0.95",
    "--top-k",
    "20",
    "--max-tokens",
    "32768",
    "--vision",
    "--vision-max-images",
    "50",
    "--vision-image-tokens",
    "16384",
    "--thinking",
]
TENSORFOLD_ENV = {
    "TENSORFOLD_VISION_WORKSPACE_MIB": "0",
    "TENSORFOLD_IMAGE_TOKENS": "16384",
    "TENSORFOLD_VIDEO_TOKENS": "16384",
    "TENSORFOLD_MEMORY_RESERVE_GIB": "4",
    "TENSORFOLD_MTP_COPY": "1",
    "TENSORFOLD_NO_UPDATE_CHECK": "1",
}
BAR = re.compile(r"model\.safetensors:\s+\d+%\|[# ]{10}\| [\d.]+G/106G")
TOKEN = "hf_GatedM0delT0kenThatStaysSecret7"


def _patches_hash(repo: RecipeRepo) -> str:
    data = b"".join(p.read_bytes() for p in sorted((repo.path / "patches").glob("*.patch")))
    return hashlib.sha256(data).hexdigest()[:12]


def _running(engine: Engine, seen: list[str], timeout: float = 180) -> dict[str, Any]:
    generation = engine.request("running")
    return engine.wait_status(
        lambda s: (
            seen.append(s["message"]) is None
            and s["generation"] == generation
            and s["state"] in ("running", "failed")
        ),
        timeout,
        "running or failed",
    )


@pytest.fixture
def shipped_images(client: docker.DockerClient):
    yield IMAGE
    for tag in (IMAGE + "-grammar", IMAGE):
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(tag, force=True)


def test_the_shipped_recipe_serves_as_start_sh_does(make_engine, client, shipped_images) -> None:
    engine: Engine = make_engine(layout="real")
    # the shipped recipe, and one test knob: a download long enough that status.json, which
    # coalesces progress to one write a second, shows its bar more than once
    engine.recipe_text = shipped_recipe(
        engine.repo.url, engine.commit, engine.network, engine.port
    ).replace("[settings]\n", '[settings]\nTEST_DOWNLOAD_SECONDS = "5"\n', 1)
    engine.start_worker()
    seen: list[str] = []
    status = _running(engine, seen)
    assert status["state"] == "running", status

    # the order: prepare.sh made the image (its label), then the grammar image on it
    base = client.images.get(IMAGE)
    assert base.labels["tf.patches"] == _patches_hash(engine.repo)
    grammar = client.images.get(IMAGE + "-grammar")
    assert grammar.labels[labels.GRAMMAR_BASE] == base.id
    container = client.containers.get(engine.container)
    assert container.image.id == grammar.id
    assert status["engine"]["image"] == IMAGE + "-grammar"
    assert "Adding structured output support" in engine.log_tail()
    bars = [m for m in seen if BAR.search(m)]
    assert bars, seen  # the download's progress became the message...
    assert all(m.count("model.safetensors") <= 1 for m in seen)  # ...one bar, never a screenful

    # started with the recipe's serve arguments, start.sh's variables and the four settings
    launch = json.loads(http_text(f"{status['url']}/tensorfold/launch.json"))
    assert launch["argv"] == SERVE_ARGS
    assert {k: v for k, v in launch["env"].items() if k.startswith("TENSORFOLD_")} == TENSORFOLD_ENV
    assert launch["env"]["HF_HUB_OFFLINE"] == "1"
    assert launch["hf_token_set"] is False
    assert launch["mounts"] == ["/root/.cache/huggingface", "/cache"]
    assert launch["ulimit"]["stack_kib"] == "65536"
    host = container.attrs["HostConfig"]
    assert host["IpcMode"] == "host"
    assert {u["Name"]: u["Hard"] for u in host["Ulimits"]} == {"stack": 67108864}
    models = json.loads(http_text(f"{status['url']}/v1/models"))
    assert models["data"][0]["id"] == "Qwen3.8-Flash-Next"

    # the same cache directories on both sides: prepare.sh filled what the container mounts
    mounts = {m["Destination"]: m["Source"] for m in container.attrs["Mounts"]}
    hf, kernels = engine.home / ".cache/huggingface", engine.home / ".cache/tensorfold-qwen38"
    assert mounts == {"/root/.cache/huggingface": str(hf), "/cache": str(kernels)}
    assert (hf / "hub" / f"models--{MODEL_ID.replace('/', '--')}" / "snapshots").is_dir()
    assert f"image={IMAGE}({base.labels['tf.patches']})" in (kernels / ".prepared").read_text()

    # adoption: a restarted worker leaves it alone, without running prepare.sh again
    before = container.attrs["State"]["StartedAt"]
    engine.stop_worker(engine.procs[-1])
    engine.start_worker()
    engine.wait_status(
        lambda s: (
            s["state"] == "running"
            and s["generation"] == status["generation"]
            and s["checkedAt"] > status["checkedAt"]
        ),
        60,
    )
    container.reload()
    assert container.attrs["State"]["StartedAt"] == before
    assert "prepare.sh" not in engine.log_tail()


def test_a_typo_fails_the_check_and_the_engine_keeps_serving(make_engine, client) -> None:
    engine: Engine = make_engine(layout="real")
    engine.start_worker()
    seen: list[str] = []
    status = _running(engine, seen)
    assert status["state"] == "running", status
    before = client.containers.get(engine.container)
    command = engine.recipe_path.read_text()
    typo = command.replace('"--kv-dtype"', '"--kv-dtpye"')
    assert typo != command
    engine.reload(recipe_text=typo)
    refused = engine.wait_status(lambda s: "--kv-dtpye" in s["message"], timeout=60)
    assert refused["state"] == "running" and refused["url"] == status["url"], refused
    assert "check refused" in refused["message"]
    assert "trying again" not in refused["message"]  # a typo does not pass by waiting
    assert engine.file_sd()
    after = client.containers.get(engine.container)
    assert (after.id, after.attrs["State"]["StartedAt"]) == (
        before.id,
        before.attrs["State"]["StartedAt"],
    )
    assert after.status == "running"
    assert json.loads(http_text(f"{status['url']}/v1/models"))["data"]
    leftovers = client.containers.list(
        all=True, filters={"label": [f"{labels.MANAGED}=check", f"{labels.NAME}={engine.name}"]}
    )
    assert leftovers == []  # the throwaway check container is gone


def _report_env(engine: Engine) -> str:
    """prepare.sh, told to write which token variables it was given (names, never values)."""
    script = (
        (engine.repo.path / "scripts" / "prepare.sh")
        .read_text()
        .replace(
            "set -euo pipefail\n",
            "set -euo pipefail\nenv | cut -d= -f1 "
            '| grep -xE "HF_TOKEN|HUGGING_FACE_HUB_TOKEN|HF_HUB_DISABLE_IMPLICIT_TOKEN" '
            '| sort > "$HOME/prepare-env" || true\n'
            '[ "${HF_TOKEN:-}" = "${EXPECTED_TOKEN:-unset}" ] && echo same >> "$HOME/prepare-env"\n'
            'echo "implicit=${HF_HUB_DISABLE_IMPLICIT_TOKEN:-}" >> "$HOME/prepare-env"\n',
            1,
        )
    )
    return engine.repo.commit("prepare.sh reports its token names", {"scripts/prepare.sh": script})


def test_the_prepare_never_inherits_the_workers_token(make_engine, tmp_path: Path) -> None:
    engine: Engine = make_engine(
        layout="real",
        env={"HF_TOKEN": TOKEN, "HUGGING_FACE_HUB_TOKEN": TOKEN},
        settings={"TEST_HF_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest()},
    )
    engine.commit = _report_env(engine)
    engine.start_worker()
    status = _running(engine, [])
    assert status["state"] == "failed", status
    assert "401" in status["message"] or "GatedRepoError" in status["message"], status
    names = (engine.home / "prepare-env").read_text().split()
    assert names == ["HF_HUB_DISABLE_IMPLICIT_TOKEN", "implicit=1"], names


def test_the_recipe_secret_is_the_token_and_never_shown(
    make_engine, client, tmp_path: Path
) -> None:
    token_file = tmp_path / "hf_token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    engine: Engine = make_engine(
        layout="real",
        secrets={"HF_TOKEN": str(token_file)},
        env={"HUGGING_FACE_HUB_TOKEN": "hf_TheWorkersOwnTokenNotToBeUsed"},
        settings={
            "TEST_HF_TOKEN_SHA256": hashlib.sha256(TOKEN.encode()).hexdigest(),
            "EXPECTED_TOKEN": TOKEN,
        },
    )
    engine.commit = _report_env(engine)
    proc = engine.start_worker()
    seen: list[str] = []
    status = _running(engine, seen)
    assert status["state"] == "running", status
    assert (engine.home / "prepare-env").read_text().split() == ["HF_TOKEN", "same", "implicit="]
    # running at all proves the gated download got the token (its sha256 is the fixture's knob)
    assert all(TOKEN not in m for m in seen)
    assert TOKEN not in (engine.dir / "status.json").read_text()
    assert TOKEN not in engine.log_tail(10_000)
    assert TOKEN not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode(errors="replace")
    container = client.containers.get(engine.container)
    assert TOKEN not in json.dumps([container.attrs["Config"]["Cmd"], container.attrs["Args"]])
