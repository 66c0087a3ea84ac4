"""The vLLM model download as a prepare step, on the real hf CLI of the real vLLM CPU image
(scripts/vllm-cpu-image.sh) against the real dockerd, from a hub of the test's own
(tests/hub_standin.py) on a test network's gateway, since the real hub cannot be reached here.

The token rules: a token only when the recipe gives one, as a read-only 0400 file named by
HF_TOKEN_PATH, never in the container's environment or arguments; without one a token in the
cache (`~/.cache/huggingface/token`, mounted with it) or in the settings is never sent. A cancel
ends a slow download at once and leaves no container. The CLI runs as the worker's uid and gid
(account.py): as a uid the image has no passwd entry for, it downloads all the same and every
file it leaves is that uid's.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Mount
from supervisor.engines.base import StepContext
from supervisor.engines.vllm import account, model
from supervisor.engines.vllm.model import ModelDownload
from supervisor.errors import Cancelled
from tests.fixtures import RUN_ID, TEST_LABEL
from tests.hub_standin import Hub
from tests.vllm_model import FILES, write_tiny_llama

pytestmark = pytest.mark.docker

REPO = "lucia-test/tiny-llama"
REVISION = "4c1b6a0e5d2f3a7b8c9d0e1f2a3b4c5d6e7f8a9b"
TOKEN = "hf_tokenvalue_" + uuid.uuid4().hex


@pytest.fixture
def network(client: docker.DockerClient) -> Iterator[tuple[str, str]]:
    name = f"lucia-test-hub-{RUN_ID}-{uuid.uuid4().hex[:6]}"
    made = client.networks.create(name, driver="bridge", labels={TEST_LABEL: RUN_ID})
    made.reload()
    gateway = made.attrs["IPAM"]["Config"][0]["Gateway"]
    yield name, gateway
    made.remove()


@pytest.fixture(scope="session")
def tiny_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("hub") / "files", seed=21)


def _download(
    image: str,
    network: str,
    cache: Path,
    hub: Hub,
    *,
    secrets: dict[str, str],
    settings: dict[str, str] | None = None,
    cancel: threading.Event | None = None,
    lines: list[str] | None = None,
    name: str = "",
) -> None:
    inside = model.snapshot({}, REPO, REVISION)
    volumes = (Mount(str(cache), "/var/cache/huggingface"),)
    where = model.Where(image, network, volumes, model.on_host(inside, volumes))
    seen = lines if lines is not None else []
    model.download(
        Runtime(),
        ModelDownload(REPO, REVISION),
        where,
        settings={"HF_ENDPOINT": hub.url, **(settings or {})},
        secrets=secrets,
        secrets_root=cache.parent / "secrets",
        labels={labels.NAME: name or f"t{RUN_ID}-download", TEST_LABEL: RUN_ID},
        ctx=StepContext(cancel or threading.Event(), seen.append),
    )


def _sent(hub: Hub) -> set[str | None]:
    """The Authorization headers of the model's own routes (the CLI also asks the hub for its
    hints, never with a token)."""
    found = {
        auth
        for path, auth in zip(hub.paths, hub.authorizations, strict=True)
        if f"/{REPO}/" in path
    }
    assert found, hub.paths
    return found


def test_the_real_hf_cli_downloads_the_pinned_revision_with_the_token_as_a_file(
    vllm_cpu_image: str,
    network: tuple[str, str],
    tiny_repo: Path,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "hf"
    lines: list[str] = []
    with Hub(REPO, REVISION, tiny_repo, network[1]) as hub:
        _download(vllm_cpu_image, network[0], cache, hub, secrets={"HF_TOKEN": TOKEN}, lines=lines)
    snapshot = cache / "hub" / "models--lucia-test--tiny-llama" / "snapshots" / REVISION
    for name in FILES:
        assert (snapshot / name).read_bytes() == (tiny_repo / name).read_bytes(), name
    assert any("/resolve/" in p for p in hub.paths), hub.paths
    assert _sent(hub) == {f"Bearer {TOKEN}"}
    assert lines[-1].endswith(f"snapshots/{REVISION}"), lines[-3:]  # the heartbeat message
    assert TOKEN not in "\n".join(lines)
    token = tmp_path / "secrets" / "HF_TOKEN" / "value"
    assert token.read_text().strip() == TOKEN and token.stat().st_mode & 0o777 == 0o400
    assert model.read_layout(snapshot) == {"layers": 2, "kv_heads": 2, "head_dim": 32}


def test_without_a_recipe_token_none_is_sent_not_even_the_caches_or_a_settings(
    vllm_cpu_image: str,
    network: tuple[str, str],
    tiny_repo: Path,
    tmp_path: Path,
) -> None:
    cache = tmp_path / "hf"
    cache.mkdir()
    (cache / "token").write_text("hf_cached_token_never_sent\n")  # huggingface_hub's default
    with Hub(REPO, REVISION, tiny_repo, network[1]) as hub:
        _download(
            vllm_cpu_image,
            network[0],
            cache,
            hub,
            secrets={},
            settings={"HF_TOKEN": "hf_setting_token_never_sent"},
        )
    assert _sent(hub) == {None}, list(zip(hub.paths, hub.authorizations, strict=True))
    assert (
        cache
        / "hub"
        / "models--lucia-test--tiny-llama"
        / "snapshots"
        / REVISION
        / "model.safetensors"
    ).is_file()


def test_a_cancel_ends_a_slow_download_within_a_second_and_inspect_shows_no_token(
    vllm_cpu_image: str,
    network: tuple[str, str],
    tiny_repo: Path,
    tmp_path: Path,
    client: docker.DockerClient,
) -> None:
    cancel = threading.Event()
    name = f"t{RUN_ID}-slow-{uuid.uuid4().hex[:4]}"
    failure: list[BaseException] = []
    ended = threading.Event()

    def run() -> None:
        try:
            _download(
                vllm_cpu_image,
                network[0],
                tmp_path / "hf",
                hub,
                secrets={"HF_TOKEN": TOKEN},
                cancel=cancel,
                name=name,
            )
        except BaseException as exc:
            failure.append(exc)
        ended.set()

    with Hub(REPO, REVISION, tiny_repo, network[1], slow=True) as hub:
        worker = threading.Thread(target=run)
        worker.start()
        deadline = time.monotonic() + 120
        while not any("/resolve/" in p and p.startswith("GET") for p in hub.paths):
            assert time.monotonic() < deadline and not ended.is_set(), (failure, hub.paths)
            time.sleep(0.2)
        (running,) = client.containers.list(filters={"label": f"{labels.NAME}={name}"})
        inspected = json.dumps(running.attrs)
        assert TOKEN not in inspected
        env = dict(item.split("=", 1) for item in running.attrs["Config"]["Env"])
        assert env["HF_TOKEN_PATH"] == "/run/lucia-secrets/HF_TOKEN/value"
        assert "HF_TOKEN" not in env and "HUGGING_FACE_HUB_TOKEN" not in env
        mounts = {m["Destination"]: m for m in running.attrs["Mounts"]}
        assert mounts["/run/lucia-secrets/HF_TOKEN"]["RW"] is False
        began = time.monotonic()
        cancel.set()
        assert ended.wait(30)
        took = time.monotonic() - began
        worker.join()
    assert len(failure) == 1 and isinstance(failure[0], Cancelled), failure
    assert client.containers.list(all=True, filters={"label": f"{labels.NAME}={name}"}) == []
    print(f"cancel of a slow download: {took:.2f} s")


def test_as_a_uid_without_a_passwd_entry_it_downloads_and_every_file_is_that_uids(
    vllm_cpu_image: str,
    network: tuple[str, str],
    tiny_repo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker's uid when it is not root, as `docker run --user` gives it: the image has no
    passwd entry for it (no HOME but /, which it cannot write)."""
    uid = gid = 4242
    monkeypatch.setattr(account, "user", lambda: f"{uid}:{gid}")
    cache = tmp_path / "hf"
    cache.mkdir(mode=0o700)
    os.chown(cache, uid, gid)  # the service user's own cache
    with Hub(REPO, REVISION, tiny_repo, network[1]) as hub:
        _download(vllm_cpu_image, network[0], cache, hub, secrets={})
    snapshot = cache / "hub" / "models--lucia-test--tiny-llama" / "snapshots" / REVISION
    assert (snapshot / "config.json").read_bytes() == (tiny_repo / "config.json").read_bytes()
    owners = {(p.lstat().st_uid, p.lstat().st_gid) for p in cache.rglob("*")}
    assert owners == {(uid, gid)}, owners
