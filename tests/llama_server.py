"""The real llama-server (Debian sid's llama.cpp-tools, scripts/llama-server-image.sh) for tests.

`llama_server_image` is the image reference: LUCIA_LLAMA_SERVER_IMAGE if set, else the newest
image the script built on this dockerd (scripts/machine.sh runs it), else the script is run now.
`llama_router` starts routers straight from docker (no worker): a models directory with a preset,
published on a labelled test network's gateway only, removed afterwards.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest

from tests import http_json
from tests.fixtures import ROOT, RUN_ID, TEST_LABEL, free_port
from tests.http_json import Response

IMAGE_SCRIPT = ROOT / "scripts" / "llama-server-image.sh"
VERSION_LABEL = "org.lucia.llama-server.version"
IMAGE_REPOSITORY = "lucia-llama-server"  # scripts/llama-server-image.sh's default repository
CONTAINER_DIR = "/models"
CONTAINER_PORT = 8080


def built_image(client: docker.DockerClient) -> str | None:
    """The newest image the script built on this dockerd, or None: tagged in the script's own
    repository, never an image built FROM it (which inherits its label: a test's router image,
    removed when that test ends)."""
    repository = os.environ.get("LUCIA_LLAMA_REPOSITORY") or IMAGE_REPOSITORY
    images = client.images.list(name=repository, filters={"label": VERSION_LABEL})
    tagged = [
        (image, tag)
        for image in images
        for tag in image.tags
        if tag.rsplit(":", 1)[0] == repository
    ]
    if not tagged:
        return None
    newest = max(tagged, key=lambda found: str(found[0].attrs["Created"]))
    return newest[1]


def build_image() -> str:
    """Run scripts/llama-server-image.sh; its last line is the image reference."""
    if os.geteuid() != 0:
        pytest.fail(
            f"no llama-server image on this dockerd, and {IMAGE_SCRIPT} needs root: run "
            "scripts/machine.sh (as root) once"
        )
    done = subprocess.run(
        ["bash", str(IMAGE_SCRIPT)], capture_output=True, text=True, timeout=1800, check=False
    )
    if done.returncode != 0 or not done.stdout.strip():
        pytest.fail(f"{IMAGE_SCRIPT} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def llama_server_image(client: docker.DockerClient) -> str:
    image = os.environ.get("LUCIA_LLAMA_SERVER_IMAGE") or built_image(client) or build_image()
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        pytest.fail(f"llama-server image {image} is not on this dockerd")
    return image


@pytest.fixture(scope="session")
def llama_network(client: docker.DockerClient) -> Iterator[tuple[str, str]]:
    """(name, gateway address) of a bridge network of this run; removed at the end."""
    name = f"lucia-test-{RUN_ID}-llama"
    network = client.networks.create(name, driver="bridge", labels={TEST_LABEL: RUN_ID})
    network.reload()
    gateway = str(network.attrs["IPAM"]["Config"][0]["Gateway"])
    yield name, gateway
    for container in network.containers:
        container.remove(force=True)
    network.remove()


@dataclass
class Section:
    """One preset section: the model file(s) relative to the models directory, and its keys."""

    name: str
    model: str
    keys: dict[str, str | int | bool] = field(default_factory=dict)

    def render(self) -> str:
        lines = [f"[{self.name}]", f"model = {CONTAINER_DIR}/{self.model}"]
        for key, value in self.keys.items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            lines.append(f"{key} = {text}")
        return "\n".join(lines) + "\n"


def render_preset(sections: Sequence[Section], defaults: dict[str, str | int] | None = None) -> str:
    text = "version = 1\n"
    if defaults:
        text += "[*]\n" + "".join(f"{key} = {value}\n" for key, value in defaults.items())
    return text + "".join(section.render() for section in sections)


@dataclass
class LlamaRouter:
    """One real router container; `url` is the gateway address it is published on."""

    container: Any
    models_dir: Path
    url: str

    def get(self, path: str, params: dict[str, str] | None = None, timeout: float = 10) -> Response:
        query = "?" + urllib.parse.urlencode(params) if params else ""
        return http_json.get(self.url + path + query, timeout)

    def post(self, path: str, document: dict[str, Any], timeout: float = 60) -> Response:
        return http_json.post(self.url + path, document, timeout)

    def models(self, reload: bool = False) -> dict[str, dict[str, Any]]:
        """GET /models: each offered model's `status` object by name."""
        answer = self.get("/models", {"reload": "1"} if reload else None)
        assert answer.status == 200, answer
        return {entry["id"]: entry["status"] for entry in answer.json()["data"]}

    def wait_status(
        self, name: str, check: Callable[[dict[str, Any]], bool], timeout: float = 60
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status: dict[str, Any] | None = None
        while time.monotonic() < deadline:
            status = self.models().get(name)
            if status is not None and check(status):
                return status
            time.sleep(0.1)
        raise AssertionError(f"{name}: last status {status}; log:\n{self.logs()[-3000:]}")

    def wait_value(self, name: str, value: str, timeout: float = 60) -> dict[str, Any]:
        return self.wait_status(name, lambda status: status["value"] == value, timeout)

    def logs(self) -> str:
        return bytes(self.container.logs()).decode(errors="replace")

    def write_preset(
        self, sections: Sequence[Section], defaults: dict[str, str | int] | None = None
    ) -> None:
        (self.models_dir / "llama-models.ini").write_text(render_preset(sections, defaults))


@pytest.fixture
def llama_router(
    client: docker.DockerClient,
    llama_server_image: str,
    llama_network: tuple[str, str],
) -> Iterator[Callable[..., LlamaRouter]]:
    """start(models_dir, sections, *, defaults=None, models_max=2, args=(), wait=True) -> a
    router whose /health answers (unless wait=False). The preset is written into models_dir,
    which is mounted read-only at /models."""
    started: list[Any] = []
    network, gateway = llama_network

    def start(
        models_dir: Path,
        sections: Sequence[Section],
        *,
        defaults: dict[str, str | int] | None = None,
        models_max: int = 2,
        args: Sequence[str] = (),
        wait: bool = True,
    ) -> LlamaRouter:
        port = free_port()
        (models_dir / "llama-models.ini").write_text(render_preset(sections, defaults))
        container = client.containers.run(
            llama_server_image,
            [
                "--models-preset",
                f"{CONTAINER_DIR}/llama-models.ini",
                "--models-max",
                str(models_max),
                "--host",
                "0.0.0.0",
                "--port",
                str(CONTAINER_PORT),
                "--metrics",
                *args,
            ],
            name=f"lucia-t{RUN_ID}-llama-{len(started)}-{port}",
            detach=True,
            labels={TEST_LABEL: RUN_ID},
            network=network,
            ports={f"{CONTAINER_PORT}/tcp": (gateway, port)},
            volumes={str(models_dir): {"bind": CONTAINER_DIR, "mode": "ro"}},
        )
        started.append(container)
        router = LlamaRouter(container, models_dir, f"http://{gateway}:{port}")
        if wait:
            wait_healthy(router)
        return router

    yield start
    for container in started:
        container.remove(force=True)


def wait_healthy(router: LlamaRouter, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if router.get("/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        router.container.reload()
        if router.container.status == "exited":
            break
        time.sleep(0.1)
    raise AssertionError(f"the router did not answer /health:\n{router.logs()[-3000:]}")
