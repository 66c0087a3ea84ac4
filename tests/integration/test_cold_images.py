"""Every image .ci/run and the tests build, built here from nothing on every run: no image of an
earlier run and no cached layer is used (`--no-cache`, or an image script run under a private
repository, label and apt directory), each under a private tag, checked to work, and removed.

A machine that already holds an image never takes its first-build path; a newcomer's machine
always does. These tests take it on every CI run.

The images: the busybox base (tests/standin.py), the vLLM stand-in (tests/vllm-standin), the
llama-server stand-in (demo/llama-router), the demo recipe's image (demo/recipe-repo), the image
the Spark recipe's prepare.sh builds (tests/tensorfold-recipe) and the grammar image the engine
builds on it (supervisor/engines/grammar.py), and the real llama-server
(scripts/llama-server-image.sh). An image script joins IMAGE_SCRIPTS with the overrides that
make its run private and a check of what it built.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.engines.tensorfold import grammar
from supervisor.engines.tensorfold.recipe import Grammar
from tests.fixtures import ROOT, RUN_ID, TEST_LABEL
from tests.gguf_fixtures import write_llama
from tests.standin import busybox_context, free_port

pytestmark = pytest.mark.docker

LABELS = {TEST_LABEL: RUN_ID}


class Cold:
    """Builds with --no-cache under private tags, and removes every one of them afterwards."""

    def __init__(self, client: docker.DockerClient) -> None:
        self.client = client
        self.tags: list[str] = []

    def tag(self, name: str) -> str:
        tag = f"lucia-test-cold-{name}-{RUN_ID}:1"
        self.tags.append(tag)
        return tag

    def build(
        self,
        name: str,
        *,
        path: Path | None = None,
        dockerfile_text: str | None = None,
        buildargs: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> str:
        """The image id; every step ran (the build log shows no cached step)."""
        tag = self.tag(name)
        source: dict[str, Any] = (
            {"path": str(path)}
            if path is not None
            else {"fileobj": io.BytesIO((dockerfile_text or "").encode())}
        )
        chunks = list(
            self.client.api.build(
                **source,
                tag=tag,
                nocache=True,
                rm=True,
                forcerm=True,
                decode=True,
                buildargs=dict(buildargs or {}),
                labels={**LABELS, **(labels or {})},
            )
        )
        log = "".join(str(chunk.get("stream", "")) for chunk in chunks)
        errors = [str(chunk["error"]) for chunk in chunks if "error" in chunk]
        assert errors == [], f"{name}: {errors}\n{log[-3000:]}"
        assert "Using cache" not in log, log
        return str(self.client.images.get(tag).id)

    def remove(self) -> None:
        for tag in self.tags:
            with contextlib.suppress(docker.errors.ImageNotFound):
                self.client.images.remove(tag, force=True)


@pytest.fixture(scope="module")
def cold(client: docker.DockerClient) -> Iterator[Cold]:
    builder = Cold(client)
    yield builder
    builder.remove()


@pytest.fixture(scope="module")
def cold_base(cold: Cold, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The busybox base, from nothing: the image every stand-in below is built on."""
    context = busybox_context(tmp_path_factory.mktemp("cold-base"))
    return cold.build("busybox", path=context)


@pytest.fixture
def containers(client: docker.DockerClient) -> Iterator[Callable[..., Any]]:
    started: list[Any] = []

    def run(image: str, command: list[str] | None = None, **kwargs: Any) -> Any:
        container = client.containers.run(image, command, detach=True, labels=LABELS, **kwargs)
        started.append(container)
        return container

    yield run
    for container in started:
        container.remove(force=True)


def answer(container: Any, port: int, path: str, wanted: str, timeout: float = 60) -> str:
    """GET path inside the container (busybox wget) until the answer holds wanted."""
    deadline = time.monotonic() + timeout
    output = ""
    while time.monotonic() < deadline:
        container.reload()
        assert container.status == "running", container.logs().decode(errors="replace")
        code, out = container.exec_run(["wget", "-qO-", f"http://127.0.0.1:{port}{path}"])
        output = bytes(out).decode(errors="replace")
        if code == 0 and wanted in output:
            return output
        time.sleep(0.2)
    raise AssertionError(f"{path}: {output!r}; log:\n{container.logs().decode(errors='replace')}")


def test_the_busybox_base(client: docker.DockerClient, cold_base: str) -> None:
    out = client.containers.run(
        cold_base, ["sh", "-c", "echo $((6 * 7)); stat -c %a /tmp"], remove=True, labels=LABELS
    )
    assert out.decode().split() == ["42", "1777"]


def test_the_vllm_stand_in(cold: Cold, cold_base: str, containers: Callable[..., Any]) -> None:
    image = cold.build(
        "vllm-standin", path=ROOT / "tests" / "vllm-standin", buildargs={"BASE": cold_base}
    )
    engine = containers(image, ["tiny-model", "--served-model-name", "tiny", "--port", "8000"])
    assert '"tiny"' in answer(engine, 8000, "/v1/models", "tiny")


def test_the_llama_server_stand_in(
    cold: Cold, cold_base: str, containers: Callable[..., Any], tmp_path: Path
) -> None:
    image = cold.build(
        "llama-router", path=ROOT / "demo" / "llama-router", buildargs={"BASE": cold_base}
    )
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + bytes(28))
    (tmp_path / "llama-models.ini").write_text(
        "version = 1\n[tiny]\nmodel = /models/tiny.gguf\nload-on-startup = true\n"
    )
    router = containers(
        image,
        ["--models-preset", "/models/llama-models.ini", "--port", "8080"],
        environment={"LOAD_DELAY": "0"},
        volumes={str(tmp_path): {"bind": "/models", "mode": "ro"}},
    )
    assert '"value":"loaded"' in answer(router, 8080, "/models", '"loaded"')


def test_the_demo_recipe_image(cold: Cold, cold_base: str, containers: Callable[..., Any]) -> None:
    image = cold.build(
        "demo-recipe", path=ROOT / "demo" / "recipe-repo", buildargs={"BASE": cold_base}
    )
    engine = containers(
        image, environment={"PORT": "8000", "MODEL_ID": "test/tiny-model", "SERVED_NAME": "tiny"}
    )
    assert '"tiny"' in answer(engine, 8000, "/v1/models", "tiny")


def test_the_spark_recipe_image_and_the_grammar_image_on_it(
    client: docker.DockerClient, cold: Cold, tmp_path: Path
) -> None:
    # prepare.sh --rebuild is its own cold path: docker build --no-cache from its inline
    # Dockerfile (FROM scratch and the host's busybox)
    image = cold.tag("tensorfold")
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path / "home"),
        "LANG": "C.UTF-8",
        "HF_CACHE": str(tmp_path / "hf"),
        "KERNEL_CACHE": str(tmp_path / "kernels"),
        "IMAGE": image,
        "PULL": "0",
        "GHCR_IMAGE": f"lucia-test-cold-ghcr-{RUN_ID}",
        "TEST_DOWNLOAD_SECONDS": "0",
        "TEST_BUILD_LABEL": f"{TEST_LABEL}={RUN_ID}",
        "TEST_RUN_LABEL": f"{TEST_LABEL}={RUN_ID}",
        **({"DOCKER_HOST": os.environ["DOCKER_HOST"]} if "DOCKER_HOST" in os.environ else {}),
    }
    (tmp_path / "home").mkdir()
    recipe = shutil.copytree(ROOT / "tests" / "tensorfold-recipe", tmp_path / "recipe")
    done = subprocess.run(
        ["./scripts/prepare.sh", "--rebuild"],
        cwd=recipe,
        env=env,
        capture_output=True,
        check=False,
        timeout=600,
    )
    out, err = done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace")
    assert done.returncode == 0, out[-3000:] + err[-3000:]
    assert "Using cache" not in out
    assert "tensorfold 0.6.6" in out
    base = client.images.get(image)
    assert base.labels["tf.patches"]
    # the grammar image: the engine's own Dockerfile text, FROM that image's id
    pin = Grammar(requirement="xgrammar>=0.2.8,<0.3", modules=["xgrammar", "tensorfold"])
    grammar_image = cold.build(
        "grammar",
        dockerfile_text=grammar.dockerfile(pin, str(base.id)),
        labels=grammar.labels(pin, str(base.id)),
    )
    assert grammar.current(pin, str(base.id), client.images.get(grammar_image).labels)
    printed = client.containers.run(
        grammar_image,
        [
            "sh",
            "-c",
            'python -c "import xgrammar, tensorfold" && '
            "cat /site/xgrammar/REQUIREMENT && tensorfold --version",
        ],
        entrypoint=[],
        remove=True,
        labels=LABELS,
    )
    assert bytes(printed).decode().splitlines() == ["xgrammar>=0.2.8,<0.3", "tensorfold 0.6.6"]


@dataclass(frozen=True)
class ImageScript:
    """A script that builds an image itself, and what makes one run of it private: its own
    repository, label and cache, so that no image or cache of the machine's is found."""

    name: str
    script: Path
    repository: str  # the private repository it builds into
    private: Callable[[Path], dict[str, str]]  # a fresh directory -> the overrides
    check: Callable[[docker.DockerClient, str, Path], None]  # the image it printed works


LLAMA_REPOSITORY = f"lucia-test-cold-llama-server-{RUN_ID}"
LLAMA_LABEL = f"lucia.test.cold.llama-server.version-{RUN_ID}"


def private_llama_server(tmp: Path) -> dict[str, str]:
    return {
        "LUCIA_LLAMA_REPOSITORY": LLAMA_REPOSITORY,
        "LUCIA_LLAMA_LABEL": LLAMA_LABEL,
        "LUCIA_LLAMA_CACHE": str(tmp / "apt"),
    }


def check_llama_server(client: docker.DockerClient, image: str, tmp: Path) -> None:
    """The real llama-server of the built image loads a tiny llama and answers /health."""
    assert client.images.get(image).labels[LLAMA_LABEL]  # the package version
    write_llama(tmp / "models" / "tiny.gguf")
    network = client.networks.create(f"lucia-test-{RUN_ID}-cold", driver="bridge", labels=LABELS)
    container = None
    try:
        network.reload()
        gateway = str(network.attrs["IPAM"]["Config"][0]["Gateway"])
        port = free_port()
        container = client.containers.run(
            image,
            ["-m", "/models/tiny.gguf", "--host", "0.0.0.0", "--port", "8080", "--ctx-size", "256"],
            detach=True,
            labels=LABELS,
            network=network.name,
            ports={"8080/tcp": (gateway, port)},
            volumes={str(tmp / "models"): {"bind": "/models", "mode": "ro"}},
        )
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline and status != 200:
            container.reload()
            assert container.status == "running", container.logs().decode(errors="replace")
            url = f"http://{gateway}:{port}/health"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as got:
                status = got.status
            time.sleep(0.2)
        assert status == 200, container.logs().decode(errors="replace")[-3000:]
    finally:
        if container is not None:
            container.remove(force=True)
        network.remove()


IMAGE_SCRIPTS = [
    ImageScript(
        "llama-server",
        ROOT / "scripts" / "llama-server-image.sh",
        LLAMA_REPOSITORY,
        private_llama_server,
        check_llama_server,
    ),
]


def run_script(script: Path, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
        env={**os.environ, **env},
    )


@pytest.mark.parametrize("case", IMAGE_SCRIPTS, ids=lambda case: case.name)
def test_an_image_script_builds_from_nothing(
    client: docker.DockerClient, case: ImageScript, tmp_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.fail(f"{case.script} runs as root; run these tests as root (as CI does)")
    private = case.private(tmp_path)
    assert client.images.list(name=case.repository) == []
    try:
        first = run_script(case.script, private)
        assert first.returncode == 0, first.stderr[-3000:]
        image = first.stdout.splitlines()[-1]
        assert image.startswith(case.repository + ":"), first.stdout
        built = client.images.get(image).id
        case.check(client, image, tmp_path)
        # run again: its own image is found, nothing is built
        again = run_script(case.script, private)
        assert again.returncode == 0, again.stderr[-3000:]
        assert again.stdout.splitlines()[-1] == image
        assert client.images.get(image).id == built
    finally:
        for leftover in client.images.list(name=case.repository):
            client.images.remove(str(leftover.id), force=True)
