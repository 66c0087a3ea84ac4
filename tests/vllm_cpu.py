"""The real vLLM CPU server (scripts/vllm-cpu-image.sh) and a tiny model it serves, for tests.

`vllm_cpu_image` is the image reference: LUCIA_VLLM_CPU_IMAGE if set, else the script's default
tag when it is on this dockerd, else the script is run now (root only; it caches by a label).
`tiny_llama_dir` is the tiny random model of tests/vllm_model.py, written once per session.
`start_vllm_cpu` runs one server container straight from docker (no worker), the model mounted
read-only, its port published on a labelled test network's gateway only; removed afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.engines.vllm import tiers as kv_tiers
from tests import http_json
from tests.fixtures import ROOT, RUN_ID, TEST_LABEL
from tests.http_json import Response
from tests.standin import free_port
from tests.vllm_model import write_tiny_llama

IMAGE_SCRIPT = ROOT / "scripts" / "vllm-cpu-image.sh"
DEFAULT_IMAGE = "lucia-vllm-cpu:0.32.0-torch2.13.0"
BUILD_LABEL = "org.lucia.vllm-cpu.build"
MODEL_DIR = "/model"
CONTAINER_PORT = 8000
SERVED_NAME = "tiny-llama"
MODEL_SEED = 21
# Docker's default /dev/shm (64 MiB) is too small for vLLM's CPU worker (it needs over 160 MiB).
SHM_SIZE = "512m"


def run_image_script(
    env: dict[str, str] | None = None, timeout: float = 3600
) -> subprocess.CompletedProcess[str]:
    """Run scripts/vllm-cpu-image.sh with env added to this process's environment."""
    return subprocess.run(
        ["bash", str(IMAGE_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
    )


def build_image() -> str:
    """Run the script (root only); its last line is the image reference."""
    if os.geteuid() != 0:
        pytest.fail(
            f"no vLLM CPU image on this dockerd, and {IMAGE_SCRIPT} needs root: run "
            "scripts/machine.sh (as root) once"
        )
    done = run_image_script()
    if done.returncode != 0 or not done.stdout.strip():
        pytest.fail(f"{IMAGE_SCRIPT} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def vllm_cpu_image(client: docker.DockerClient) -> str:
    image = os.environ.get("LUCIA_VLLM_CPU_IMAGE")
    if not image:
        try:
            client.images.get(DEFAULT_IMAGE)
            image = DEFAULT_IMAGE
        except docker.errors.ImageNotFound:
            image = build_image()
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        pytest.fail(f"vLLM CPU image {image} is not on this dockerd")
    return image


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=MODEL_SEED)


@dataclass
class VllmServer:
    """One real vLLM container; `url` is the gateway address it is published on."""

    container: Any
    url: str
    seconds_to_health: float

    def get(self, path: str, timeout: float = 10) -> Response:
        return http_json.get(self.url + path, timeout)

    def post(self, path: str, document: dict[str, Any], timeout: float = 120) -> Response:
        return http_json.post(self.url + path, document, timeout)

    def logs(self) -> str:
        return bytes(self.container.logs()).decode(errors="replace")


BLOCK_TOKENS = 128  # the CPU backend's KV block: a prompt is keyed, loaded and saved by these
PROMPT_SOURCE = re.compile(  # vllm:prompt_tokens_by_source_total: (source, tokens)
    r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([^"]+)"[^}]*\} (\S+)$', re.M
)
WAIT = 300.0  # the longest wait for the tier plugin's writers; a limit, never an assertion


def wait_for(
    condition: Callable[[], bool], what: str, seen: Callable[[], str] = lambda: ""
) -> None:
    """Poll condition until it holds; after WAIT seconds fail, naming what and what was seen."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > WAIT:
            raise AssertionError(f"gave up waiting for {what} {seen()}".rstrip())
        time.sleep(0.5)


def wait_healthy(
    container: Any, url: str, timeout: float, fail: type[Exception] = AssertionError
) -> float:
    """Seconds until vLLM's /health answered 200; its exit or the timeout raise fail, with the
    log's tail."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        container.reload()
        if container.status in {"exited", "dead"}:
            logs = bytes(container.logs()).decode(errors="replace")
            raise fail(f"vLLM exited ({container.attrs['State']}):\n{logs[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as answer:
                if answer.status == 200:
                    return time.monotonic() - started
        except (OSError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    logs = bytes(container.logs()).decode(errors="replace")
    raise fail(f"vLLM's /health did not answer within {timeout:.0f} s:\n{logs[-4000:]}")


@pytest.fixture(scope="module")
def start_vllm_cpu(
    client: docker.DockerClient, vllm_cpu_image: str, tiny_llama_dir: Path
) -> Iterator[Callable[..., VllmServer]]:
    """start(args=(), kv_cache_gib=1, timeout=600, image=None, volumes=None, environment=None)
    -> a server whose /health answered; image defaults to vllm_cpu_image, volumes and
    environment are added to the model's mount and the KV cache size."""
    name = f"lucia-test-{RUN_ID}-vllm-cpu-{free_port()}"
    network = client.networks.create(name, driver="bridge", labels={TEST_LABEL: RUN_ID})
    network.reload()
    gateway = str(network.attrs["IPAM"]["Config"][0]["Gateway"])
    started: list[Any] = []

    def start(
        args: Sequence[str] = (),
        kv_cache_gib: int = 1,
        timeout: float = 600,
        image: str | None = None,
        volumes: dict[str, dict[str, str]] | None = None,
        environment: dict[str, str] | None = None,
    ) -> VllmServer:
        port = free_port()
        container = client.containers.run(
            image or vllm_cpu_image,
            [
                "--model",
                MODEL_DIR,
                "--served-model-name",
                SERVED_NAME,
                "--host",
                "0.0.0.0",  # the container's own address; published on the gateway
                "--port",
                str(CONTAINER_PORT),
                "--dtype",
                "bfloat16",
                "--max-model-len",
                "1024",
                *args,
            ],
            detach=True,
            name=f"lucia-t{RUN_ID}-vllm-{port}",
            labels={TEST_LABEL: RUN_ID},
            network=name,
            ports={f"{CONTAINER_PORT}/tcp": (gateway, port)},
            volumes={str(tiny_llama_dir): {"bind": MODEL_DIR, "mode": "ro"}, **(volumes or {})},
            shm_size=SHM_SIZE,
            environment={
                "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                "HF_HUB_OFFLINE": "1",
                **(environment or {}),
            },
        )
        started.append(container)
        url = f"http://{gateway}:{port}"
        return VllmServer(container, url, wait_healthy(container, url, timeout))

    yield start
    for container in started:
        container.remove(force=True)
    network.remove()


def library_revision(files: Path, guid: str) -> str:
    """The file digest a library model is known by (its model revision): each file's size and
    change time, so a re-copied file is another revision."""
    found = {
        entry.name: f"{entry.stat().st_size}:{entry.stat().st_mtime_ns}"
        for entry in os.scandir(files)
    }
    manifest = kv_tiers.library_manifest(guid, found)
    return hashlib.sha256(manifest.encode()).hexdigest()[:16]


@pytest.fixture(scope="session")
def vllm_cpu_images(client: docker.DockerClient, vllm_cpu_image: str) -> Iterator[tuple[str, str]]:
    """The CPU image, and a second image of the same server with another id (one label layer
    on top, as a rebuild would give): a recipe that names the second replaces the engine."""
    tag = f"lucia-test-vllm-cpu-{RUN_ID}:rebuilt"
    dockerfile = f"FROM {vllm_cpu_image}\nLABEL {TEST_LABEL}={RUN_ID}\n"
    client.images.build(
        fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, labels={TEST_LABEL: RUN_ID}
    )
    yield vllm_cpu_image, tag
    with contextlib.suppress(docker.errors.APIError):
        client.images.remove(tag, force=True)
