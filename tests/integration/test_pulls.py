"""Real pulls from a registry of the tests' own (tests/registry.py), with the real dockerd.

`Runtime.pull` directly: a tag and a digest are pulled, with Docker's progress as lines; a
missing tag is a Permanent error naming it; a registry that does not answer is Transient. Then
the vLLM engine's worker with a mirror `repository` on a registry with a port: it pulls the tag
its preflight picks, status.json shows the download's progress during the pull, and the
container runs on the pulled image.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import docker
import pytest

from supervisor.docker.labels import TIERS_BASE
from supervisor.docker.runtime import Runtime
from supervisor.engines.vllm import preflight as pf
from supervisor.engines.vllm import tier_image
from supervisor.errors import Permanent, Transient
from tests.fixtures import RUN_ID, TEST_LABEL, Engine
from tests.registry import Gate, Registry, ours, publish, remove_ours
from tests.standin import free_port

pytestmark = pytest.mark.docker

FILLER = 40 * 1024 * 1024  # one layer of random bytes: gzip leaves it as large in the registry
PICKED = pf.STABLE_CUDA12_IMAGE.split(":", 1)[1]  # what the preflight picks on an H100 (CUDA 12)
PATH = pf.REPOSITORY  # the mirror keeps vllm/vllm-openai's own path
PROGRESS = re.compile(r"Downloading (\d+\.\d)MB/(\d+\.\d)MB")


@dataclass(frozen=True)
class Published:
    """The vLLM stand-in with a large layer, in the registry only (not held locally)."""

    id: str
    tag: str


@pytest.fixture(scope="session")
def published(
    client: docker.DockerClient,
    registry: Registry,
    vllm_images: tuple[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Published:
    context = tmp_path_factory.mktemp("pulled")
    with open(context / "filler", "wb") as out:
        out.write(os.urandom(FILLER))
    (context / "Dockerfile").write_text(
        f"FROM {vllm_images[0]}:{PICKED}\nCOPY filler /opt/lucia-filler\n"
    )
    local = f"lucia-test-pulled-{RUN_ID}:1"
    client.images.build(path=str(context), tag=local, rm=True, labels={TEST_LABEL: RUN_ID})
    try:
        image_id = publish(client, local, f"{registry.host}/{PATH}:{PICKED}")
    finally:
        client.images.remove(local)  # its big layer goes with it: a pull must download it
    (context / "filler").unlink()
    return Published(image_id, PICKED)


@pytest.fixture
def pulled(client: docker.DockerClient, registry: Registry) -> Iterator[list[str]]:
    """Hosts whose pulled images of this run are removed before and after the test (the
    registry's own host is always one)."""
    hosts = [registry.host]

    remove_ours(client, tuple(hosts))
    yield hosts
    remove_ours(client, tuple(hosts))


def _pull(ref: str) -> tuple[str, list[str]]:
    lines: list[str] = []
    image = Runtime().pull(ref, lines.append, threading.Event())
    return image.id, lines


def test_runtime_pulls_a_tag_and_a_digest_from_the_registry_with_progress(
    client: docker.DockerClient,
    registry: Registry,
    published: Published,
    pulled: list[str],
) -> None:
    ref = f"{registry.host}/{PATH}:{published.tag}"
    image_id, lines = _pull(ref)
    assert image_id == published.id == client.images.get(ref).id
    downloads = [m for line in lines if (m := PROGRESS.search(line))]
    assert downloads, lines
    assert float(downloads[-1][2]) == pytest.approx(FILLER / 1e6, rel=0.01)
    assert f"Status: Downloaded newer image for {ref}" in lines
    digest = next(
        d for d in client.images.get(ref).attrs["RepoDigests"] if d.startswith(f"{registry.host}/")
    )
    remove_ours(client, (registry.host,))
    assert ours(client, (registry.host,)) == []
    by_digest, lines = _pull(digest)
    assert by_digest == published.id
    assert any(PROGRESS.search(line) for line in lines), lines


def test_a_missing_tag_is_a_permanent_error_naming_it(
    registry: Registry,
    published: Published,
    pulled: list[str],
) -> None:
    ref = f"{registry.host}/{PATH}:v0.0.0-missing"
    with pytest.raises(Permanent) as info:
        _pull(ref)
    assert not isinstance(info.value, Transient)
    message = str(info.value)
    assert message.startswith(f"pull of {ref} failed: ") and "not found" in message


def test_a_registry_that_does_not_answer_is_transient() -> None:
    ref = f"127.0.0.1:{free_port()}/{PATH}:{PICKED}"  # nothing listens there
    with pytest.raises(Transient) as info:
        _pull(ref)
    message = str(info.value)
    assert message.startswith(f"pull of {ref}: the registry did not answer (")
    assert "connection refused" in message


def test_the_vllm_worker_pulls_the_picked_tag_from_a_mirror_with_a_port(
    client: docker.DockerClient,
    registry: Registry,
    published: Published,
    pulled: list[str],
    make_engine: Callable[..., Engine],
) -> None:
    # through the gate: the download is held after a fifth, until status.json showed it
    with Gate(registry, hold_after=FILLER // 5) as gate:
        host = f"localhost:{gate.port}"
        pulled.append(host)
        engine = make_engine(kind="vllm", vllm_repository=f"{host}/{PATH}")
        engine.start_worker()
        generation = engine.request("running")
        seen = _messages_until_progress(engine, gate, timeout=120)
        running = engine.wait_state(generation, "running", timeout=120)
    ref = f"{host}/{PATH}:{PICKED}"
    shown = [m for m in seen if PROGRESS.search(m)]
    assert shown, seen
    current, total = (float(x) for x in PROGRESS.findall(shown[-1])[-1])
    assert 0 < current < total == pytest.approx(FILLER / 1e6, rel=0.01)
    assert gate.held.is_set()
    assert client.images.get(ref).id == published.id
    # the recipe has KV tiers: the engine runs on the tier layer built FROM the pulled image
    layered = client.images.get(tier_image.tag(ref))
    assert layered.labels[TIERS_BASE] == published.id
    container = client.containers.get(engine.container)
    assert container.image.id == layered.id
    assert running["engine"]["image"] == tier_image.tag(ref)
    assert running["engine"]["imageId"] == layered.id


def _messages_until_progress(engine: Engine, gate: Gate, timeout: float) -> list[str]:
    """status.json's messages, sampled until one shows the download's progress; then the
    gate lets the download go on."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            status = engine.status() or {}
            message = str(status.get("message", ""))
            if message and (not seen or seen[-1] != message):
                seen.append(message)
            if PROGRESS.search(message):
                return seen
            if status.get("state") in ("failed", "running"):
                break
            time.sleep(0.05)
        raise AssertionError(f"no progress in status.json; saw {seen}; log: {engine.log_tail()}")
    finally:
        gate.release()
