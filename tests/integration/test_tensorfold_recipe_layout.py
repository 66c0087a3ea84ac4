"""The fixture repository with the real Spark recipe's layout (tests/tensorfold-recipe), exercised
directly: its prepare.sh against the real dockerd, and the image it leaves serving as start.sh would
start it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from tests.fixtures import ROOT, RUN_ID, TEST_LABEL, free_port, git, http_text

pytestmark = pytest.mark.docker

TEMPLATE = ROOT / "tests" / "tensorfold-recipe"
MODEL_ID = "local-inference-lab/Qwen3.8-Flash-Next-NVFP4"
CHECK_PROGRAM = (
    "import sys; from tensorfold.cli import build_parser; build_parser().parse_args(sys.argv[1:])"
)
# start.sh's serve arguments: scripts/config.sh's defaults with the operators' PARALLEL and CONTEXT
SERVE_ARGS = [
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
PROGRESS = re.compile(r"model\.safetensors:\s+(\d+)%\|[# ]{10}\| [\d.]+G/106G")


@dataclass
class Recipe:
    """One copy of the fixture repository with its own HOME, HF cache and kernel cache."""

    path: Path
    home: Path
    image: str

    def env(self, hf_cache: Path, kernel_cache: Path, **extra: str) -> dict[str, str]:
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "LANG": "C.UTF-8",
            "HF_CACHE": str(hf_cache),
            "KERNEL_CACHE": str(kernel_cache),
            "IMAGE": self.image,
            "GHCR_IMAGE": f"lucia-test-ghcr-{RUN_ID}",
            "TEST_DOWNLOAD_SECONDS": "0.5",
            "TEST_BUILD_LABEL": f"{TEST_LABEL}={RUN_ID}",
            "TEST_RUN_LABEL": f"{TEST_LABEL}={RUN_ID}",
        }
        if "DOCKER_HOST" in os.environ:
            env["DOCKER_HOST"] = os.environ["DOCKER_HOST"]
        return {**env, **extra}

    def prepare(
        self, hf_cache: Path, kernel_cache: Path, *args: str, **extra: str
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["./scripts/prepare.sh", *args],
            cwd=self.path,
            check=False,
            capture_output=True,
            env=self.env(hf_cache, kernel_cache, **extra),
            timeout=300,
        )
        # decoded by hand: text mode would turn the progress's carriage returns into newlines
        return subprocess.CompletedProcess(
            result.args, result.returncode, result.stdout.decode(), result.stderr.decode()
        )

    def patches_hash(self) -> str:
        data = b"".join(p.read_bytes() for p in sorted((self.path / "patches").glob("*.patch")))
        return hashlib.sha256(data).hexdigest()[:12]


def _copy(tmp: Path, image: str) -> Recipe:
    path = tmp / "recipe"
    shutil.copytree(TEMPLATE, path)
    git(path, "init", "-q", "-b", "main")
    git(path, "add", "-A")
    git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "recipe 0.7.0")
    home = tmp / "home"
    home.mkdir()
    return Recipe(path, home, image)


@dataclass
class Prepared:
    recipe: Recipe
    hf_cache: Path
    kernel_cache: Path
    first: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def prepared(
    client: docker.DockerClient, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prepared]:
    tmp = tmp_path_factory.mktemp("tf-layout")
    recipe = _copy(tmp, f"lucia-test-tf-{RUN_ID}:v0.6.6")
    hf_cache, kernel_cache = tmp / "hf", tmp / "kernels"
    first = recipe.prepare(hf_cache, kernel_cache)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    yield Prepared(recipe, hf_cache, kernel_cache, first)
    for tag in (recipe.image, f"lucia-test-tf2-{RUN_ID}:v0.6.6"):
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(tag, force=True)


def _snapshot(hf_cache: Path) -> Path:
    model = hf_cache / "hub" / f"models--{MODEL_ID.replace('/', '--')}"
    snapshots = list((model / "snapshots").glob("*"))
    assert len(snapshots) == 1, snapshots
    return snapshots[0]


def test_the_layout_has_no_root_dockerfile() -> None:
    assert not (TEMPLATE / "Dockerfile").exists()
    assert sorted(p.name for p in (TEMPLATE / "scripts").iterdir()) == ["config.sh", "prepare.sh"]
    assert (TEMPLATE / "start.sh").is_file() and list((TEMPLATE / "patches").glob("*.patch"))


def test_prepare_builds_the_labelled_image_downloads_and_marks(
    prepared: Prepared, client: docker.DockerClient
) -> None:
    out = prepared.first.stdout
    recipe = prepared.recipe
    image = client.images.get(recipe.image)
    want = recipe.patches_hash()
    assert image.labels["tf.patches"] == want
    assert image.labels[TEST_LABEL] == RUN_ID
    assert "HF_HOME=/root/.cache/huggingface" in image.attrs["Config"]["Env"]
    assert "TORCH_EXTENSIONS_DIR=/cache/torch_extensions" in image.attrs["Config"]["Env"]
    assert f"Building {recipe.image}" in out
    # the patches are in the image (its build output is not: a cached layer prints nothing)
    features = client.containers.run(
        recipe.image,
        ["/site/tensorfold/features"],
        entrypoint="cat",
        remove=True,
        labels={TEST_LABEL: RUN_ID},
    ).decode()
    assert "copy-drafts" in features and "request-body-mib 96" in features, features
    # carriage-return progress, hf download style, rising to 100%
    assert "\r" in out
    percents = [int(m.group(1)) for m in PROGRESS.finditer(out)]
    assert len(percents) > 5 and percents == sorted(percents) and percents[-1] == 100
    snapshot = _snapshot(prepared.hf_cache)
    weights = snapshot / "model.safetensors"
    assert weights.is_symlink() and weights.resolve().parent.name == "blobs"
    assert weights.stat().st_size == 106 * 1024
    assert (snapshot / "config.json").is_file()
    assert f"{MODEL_ID}  (revision {snapshot.name})" in out  # tensorfold info ran
    marker = (prepared.kernel_cache / ".prepared").read_text()
    assert marker == f"model={MODEL_ID}(present) image={recipe.image}({want}) patches={want}\n"
    assert (prepared.kernel_cache / "torch_extensions").is_dir()
    # HF_CACHE and KERNEL_CACHE from the environment win: nothing went to $HOME/.cache
    assert not (recipe.home / ".cache").exists()


def test_a_second_prepare_skips_what_is_done(
    prepared: Prepared, client: docker.DockerClient
) -> None:
    before = client.images.get(prepared.recipe.image).id
    again = prepared.recipe.prepare(prepared.hf_cache, prepared.kernel_cache)
    assert again.returncode == 0, again.stderr
    assert "already built with patches" in again.stdout
    assert "Step 1/" not in again.stdout and not PROGRESS.search(again.stdout)
    assert "model.safetensors: already downloaded" in again.stdout
    assert client.images.get(prepared.recipe.image).id == before


def test_a_concurrent_prepare_is_refused_while_the_lock_is_held(
    prepared: Prepared, tmp_path: Path
) -> None:
    hf, kernels = tmp_path / "hf", tmp_path / "kernels"
    recipe = prepared.recipe
    slow = subprocess.Popen(
        ["./scripts/prepare.sh"],
        cwd=recipe.path,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=recipe.env(hf, kernels, TEST_DOWNLOAD_SECONDS="6"),
    )
    assert slow.stdout is not None
    for line in slow.stdout:  # the lock is taken before anything is logged, held to the end
        if line.startswith("[prepare.sh] Downloading"):
            break
    else:
        raise AssertionError(f"the first prepare.sh never reached the download: {slow.stderr}")
    second = recipe.prepare(hf, kernels)
    _, err = slow.communicate(timeout=120)
    assert second.returncode == 1
    assert second.stderr.strip().splitlines() == [
        "[prepare.sh] ERROR: another prepare.sh is already running (it holds the download locks); "
        "wait for it or stop it: pgrep -af prepare.sh"
    ]
    assert slow.returncode == 0, err
    assert (kernels / ".prepared").is_file()


def test_an_interrupted_download_resumes(prepared: Prepared, tmp_path: Path) -> None:
    hf, kernels = tmp_path / "hf", tmp_path / "kernels"
    broken = prepared.recipe.prepare(hf, kernels, TEST_PULL_FAIL_AT="50")
    assert broken.returncode == 1
    assert "Connection broken" in broken.stderr.strip().splitlines()[-1]
    partial = list((hf / "hub").rglob("*.incomplete"))
    assert len(partial) == 1 and 0 < partial[0].stat().st_size < 106 * 1024
    assert not (kernels / ".prepared").exists()
    resumed = prepared.recipe.prepare(hf, kernels)
    assert resumed.returncode == 0, resumed.stderr
    assert "Resuming model.safetensors from" in resumed.stdout
    assert "config.json: already downloaded" in resumed.stdout
    assert (_snapshot(hf) / "model.safetensors").stat().st_size == 106 * 1024
    assert not list((hf / "hub").rglob("*.incomplete"))


def test_a_gated_download_takes_the_token_by_name_only(prepared: Prepared, tmp_path: Path) -> None:
    secret = "hf_fixture_secret_value"
    gate = {"TEST_HF_TOKEN_SHA256": hashlib.sha256(secret.encode()).hexdigest()}
    refused = prepared.recipe.prepare(tmp_path / "hf1", tmp_path / "k1", **gate)
    assert refused.returncode == 1
    assert "401 Client Error" in refused.stderr
    allowed = prepared.recipe.prepare(tmp_path / "hf2", tmp_path / "k2", HF_TOKEN=secret, **gate)
    assert allowed.returncode == 0, allowed.stderr
    assert "Using the token in HF_TOKEN" in allowed.stdout
    assert secret not in allowed.stdout + allowed.stderr


@pytest.mark.parametrize(
    ("args", "extra", "last_line"),
    [
        (["--bogus"], {}, "[prepare.sh] ERROR: unknown argument: --bogus"),
        ([], {"DRAFT_LANGUAGE": "xx"}, "[prepare.sh] ERROR: DRAFT_LANGUAGE=xx: zh or ja"),
        ([], {"TEST_FAIL": "info"}, "header length does not match the file (TEST_FAIL=info)"),
        ([], {"TEST_FAIL": "pull"}, "503 Server Error"),
    ],
)
def test_what_prepare_cannot_do_ends_it_with_one_line(
    prepared: Prepared, tmp_path: Path, args: list[str], extra: dict[str, str], last_line: str
) -> None:
    result = prepared.recipe.prepare(tmp_path / "hf", tmp_path / "k", *args, **extra)
    assert result.returncode == 1
    assert last_line in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "k" / ".prepared").exists()


def test_a_prebuilt_image_is_taken_instead_of_a_build(
    prepared: Prepared, client: docker.DockerClient
) -> None:
    recipe = prepared.recipe
    want = recipe.patches_hash()
    prebuilt = f"lucia-test-ghcr-{RUN_ID}:v0.6.6-{want}"
    client.images.get(recipe.image).tag(prebuilt)
    other = f"lucia-test-tf2-{RUN_ID}:v0.6.6"
    try:
        result = recipe.prepare(prepared.hf_cache, prepared.kernel_cache, IMAGE=other)
        assert result.returncode == 0, result.stderr
        assert f"Using {prebuilt} as {other}" in result.stdout and "Step 1/" not in result.stdout
        assert client.images.get(other).labels["tf.patches"] == want
        marker = (prepared.kernel_cache / ".prepared").read_text()
        assert f"image={other}({want})" in marker
    finally:
        client.images.remove(prebuilt)


def test_new_patches_rebuild_the_image_with_their_label(
    client: docker.DockerClient, tmp_path: Path
) -> None:
    recipe = _copy(tmp_path, f"lucia-test-tf3-{RUN_ID}:v0.6.6")
    hf, kernels = tmp_path / "hf", tmp_path / "kernels"
    try:
        first = recipe.prepare(hf, kernels, PULL="0")
        assert first.returncode == 0, first.stderr
        old = client.images.get(recipe.image).labels["tf.patches"]
        shutil.copy(
            recipe.path / "patches" / "languages" / "0010-flash-next-draft-languages.patch",
            recipe.path / "patches" / "0010-flash-next-draft-languages.patch",
        )
        second = recipe.prepare(hf, kernels, PULL="0")
        assert second.returncode == 0, second.stderr
        assert "applying /opt/tf-patches/0010-flash-next-draft-languages.patch" in second.stdout
        new = client.images.get(recipe.image).labels["tf.patches"]
        assert new == recipe.patches_hash() != old
    finally:
        with contextlib.suppress(docker.errors.ImageNotFound):
            client.images.remove(recipe.image, force=True)


def _serve(
    client: docker.DockerClient, prepared: Prepared, args: list[str], env: dict[str, str]
) -> tuple[docker.models.containers.Container, int]:
    port = free_port()
    container = client.containers.run(
        prepared.recipe.image,
        ["tensorfold", "serve", MODEL_ID, "--host", "0.0.0.0", "--port", "8888", *args],
        name=f"lucia-t{RUN_ID}-serve-{port}",
        detach=True,
        labels={TEST_LABEL: RUN_ID},
        ports={"8888/tcp": ("127.0.0.1", port)},
        environment=env,
        ipc_mode="host",
        ulimits=[docker.types.Ulimit(name="stack", soft=67108864, hard=67108864)],
        volumes={
            str(prepared.hf_cache): {"bind": "/root/.cache/huggingface", "mode": "rw"},
            str(prepared.kernel_cache): {"bind": "/cache", "mode": "rw"},
        },
    )
    return container, port


def _wait_ready(container: docker.models.containers.Container, port: int, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return http_text(f"http://127.0.0.1:{port}/v1/models")
        except OSError:
            container.reload()
            assert container.status in ("created", "running"), container.logs().decode()
            time.sleep(0.2)
    raise AssertionError(f"not ready: {container.logs().decode()}")


def test_the_image_serves_as_start_sh_starts_it(
    prepared: Prepared, client: docker.DockerClient
) -> None:
    env = {
        "HF_HUB_OFFLINE": "1",
        "TENSORFOLD_VISION_WORKSPACE_MIB": "0",
        "TENSORFOLD_IMAGE_TOKENS": "16384",
        "TENSORFOLD_VIDEO_TOKENS": "16384",
        "TENSORFOLD_MEMORY_RESERVE_GIB": "4",
        "TENSORFOLD_MTP_COPY": "1",
        "TENSORFOLD_NO_UPDATE_CHECK": "1",
        "TENSORFOLD_TEST_READY_DELAY": "1",
    }
    container, port = _serve(client, prepared, SERVE_ARGS, env)
    try:
        models = json.loads(_wait_ready(container, port, 30))
        assert [m["id"] for m in models["data"]] == ["Qwen3.8-Flash-Next"]
        assert "vllm:num_requests_running" in http_text(f"http://127.0.0.1:{port}/metrics")
        launch = json.loads(http_text(f"http://127.0.0.1:{port}/tensorfold/launch.json"))
        assert launch["argv"] == [
            "serve",
            MODEL_ID,
            "--host",
            "0.0.0.0",
            "--port",
            "8888",
            *SERVE_ARGS,
        ]
        tensorfold_env = {k: v for k, v in launch["env"].items() if k.startswith("TENSORFOLD_")}
        assert tensorfold_env == {k: v for k, v in env.items() if k.startswith("TENSORFOLD_")}
        assert launch["env"]["HF_HUB_OFFLINE"] == "1"
        assert launch["hf_token_set"] is False
        assert launch["mounts"] == ["/root/.cache/huggingface", "/cache"]
        assert launch["ulimit"]["stack_kib"] == "65536"
        assert "copy-drafts" in launch["features"]  # patches/0002 is in the image
        logs = container.logs().decode()
        assert "startup estimate 83.07 GiB within 111.71 GiB" in logs
        container.stop(timeout=10)
        container.reload()
        assert container.attrs["State"]["ExitCode"] == 0
    finally:
        container.remove(force=True)


def test_the_engine_dies_with_the_code_it_is_told(
    prepared: Prepared, client: docker.DockerClient
) -> None:
    container, _ = _serve(
        client, prepared, ["--name", "x"], {"HF_HUB_OFFLINE": "1", "TENSORFOLD_TEST_EXIT_CODE": "7"}
    )
    try:
        assert container.wait(timeout=30)["StatusCode"] == 7
        assert "exiting with 7" in container.logs().decode()
    finally:
        container.remove(force=True)


def _check(client: docker.DockerClient, image: str, args: list[str]) -> tuple[int, str]:
    """start.sh's check: TensorFold's own parser in a throwaway container (no GPU, no mounts)."""
    result = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            "--label",
            f"{TEST_LABEL}={RUN_ID}",
            "--entrypoint",
            "python",
            image,
            "-c",
            CHECK_PROGRAM,
            "serve",
            MODEL_ID,
            "--host",
            "0.0.0.0",
            "--port",
            "8888",
            *args,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return result.returncode, result.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (SERVE_ARGS, 0, ""),
        ([*SERVE_ARGS, "--no-thinking", "--context=131072"], 0, ""),
        (
            [*SERVE_ARGS, "--paralel", "8"],
            2,
            "tensorfold: error: unrecognized arguments: --paralel 8",
        ),
        (
            [*SERVE_ARGS, "--kv-dtype", "fp8"],
            2,
            "tensorfold serve: error: argument --kv-dtype: invalid choice: 'fp8' "
            "(choose from 'bf16', 'int8', 'int4')",
        ),
        (
            ["--parallel", "four"],
            2,
            "tensorfold serve: error: argument --parallel: invalid int value: 'four'",
        ),
        (["--mtp-confidence", "high"], 2, "argument --mtp-confidence: invalid float value: 'high'"),
        (["--context"], 2, "tensorfold serve: error: argument --context: expected one argument"),
        (["--vision-i", "9"], 0, ""),
        (["--vision-"], 2, "ambiguous option: --vision- could match"),
    ],
)
def test_the_check_mode_is_tensorfolds_parser(
    prepared: Prepared, client: docker.DockerClient, args: list[str], code: int, message: str
) -> None:
    got, stderr = _check(client, prepared.recipe.image, args)
    assert got == code, stderr
    if message:
        assert stderr.startswith("usage: tensorfold")
        assert message in stderr.strip().splitlines()[-1]
    else:
        assert stderr == ""
