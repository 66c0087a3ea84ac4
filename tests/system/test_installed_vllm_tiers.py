"""The KV tiers as the documented installation runs them: install.sh as the non-root service
user `lucia`, its systemd user service, the real vLLM 0.32.0 CPU server on the tier image.

The worker creates the tier namespaces 0700 as the test user; the engine container runs as its uid
and gid, so the tier plugin (which opens only directories its own uid owns) opens them, and a
prompt answered before a stop and start through the protocol comes back from the tiers after
it; with the NVMe copy deleted the HDD serves it and the copy comes back; with a byte flipped in
every block the answer is recomputed, the same, by the same engine, and every block is saved
again. Every file the engine wrote is the test user's: it can remove it all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
from lucia_kv.tier import NAME as BLOCK_NAME

from supervisor.engines.vllm import tier_image
from tests import http_json
from tests.gguf_fixtures import add_model
from tests.kv.support import flip_one_byte
from tests.standin import free_port
from tests.system.harness import RUN_ID, USER, Installation, as_user, systemctl, wait_for
from tests.vllm_cpu import BLOCK_TOKENS, PROMPT_SOURCE
from tests.vllm_cpu import wait_for as wait_until

pytestmark = pytest.mark.system

PROMPT = [random.Random(2525).randrange(3, 512) for _ in range(2000)]  # token ids, no specials
FULL_BLOCKS = len(PROMPT) // BLOCK_TOKENS
SERVED = "tiny"
START_LIMIT = 1800.0  # the tier image build, then the server's load on a loaded machine


def _recipe(name: str, work: Path, base: str, port: int, network: str) -> str:
    return f"""name = "{name}"
engine = "vllm"
model = "tiny-llama"
[vllm]
device = "cpu"
image = "{base}"
kv_cache_gib = 1
served_name = "{SERVED}"
max_model_len = 2048
prefix_caching = false
args = ["--dtype", "bfloat16", "--enforce-eager"]
[vllm.model.library]
models_dir = "{work / 'models'}"
guid = "tiny-llama"
[tiers]
nvme = {{ path = "{work / 'kv-nvme'}", max_bytes = "64m" }}
hdd = {{ path = "{work / 'kv-hdd'}", max_bytes = "256m" }}
key_secret = "LUCIA_KV_KEY"
[secrets]
LUCIA_KV_KEY = "{work / 'kv.key'}"
[settings]
HF_HUB_OFFLINE = 1
[run]
network = "{network}"
port = {port}
ready_path = "/health"
metrics_path = "/metrics"
ready_timeout = 900
stop_grace = 60
shm_size = "512m"
memory = "3g"
"""


def _gid() -> int:
    return pwd.getpwnam(USER).pw_gid


@dataclasses.dataclass
class Served:
    installed: Installation
    work: Path

    def request(self, desired: str) -> dict[str, Any]:
        """`lucia-supervisor request` as the test user, then the status once it settles (either
        way)."""
        out = self.installed.request(desired)
        generation = int(out.stdout.splitlines()[0])

        def settled() -> dict[str, Any] | None:
            status = self.installed.status() or {}
            done = status.get("generation") == generation and status.get("state") in (
                desired, "failed")
            return status if done else None

        status: dict[str, Any] = wait_for(settled, START_LIMIT, f"{desired} or failed")
        assert status["state"] == desired, status.get("message")
        return status

    def tier_files(self, tier: str) -> list[Path]:
        """Every file the engine left in a tier (blocks, the owner lock), temp files aside."""
        return sorted(p for p in (self.work / f"kv-{tier}").rglob("*")
                      if p.is_file() and not p.name.startswith(".tmp-"))

    def blocks(self, tier: str) -> list[Path]:
        return [p for p in self.tier_files(tier) if BLOCK_NAME.fullmatch(p.name)]


def _complete(url: str) -> tuple[tuple[int, ...], float]:
    """The answer's token ids, and the prompt tokens the server says came from the tiers."""
    answer = http_json.post(url + "/v1/completions", {
        "model": SERVED, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=600)
    assert answer.status == 200, answer.body[-2000:]
    (choice,) = answer.json()["choices"]
    metrics = http_json.get(url + "/metrics", 30).body.decode()
    external = sum(float(m.group(2)) for m in PROMPT_SOURCE.finditer(metrics)
                   if m.group(1) == "external_kv_transfer")
    return tuple(choice["token_ids"]), external


@pytest.fixture(scope="module")
def served(installation: Installation, client: docker.DockerClient, vllm_cpu_image: str,
           tiny_llama_dir: Path) -> Iterator[Served]:
    name = f"kv{RUN_ID}"
    work = installation.home / f"lucia-system-test-{RUN_ID}-kv"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    files = add_model(work / "models", "Ready", guid="tiny-llama")
    shutil.copytree(tiny_llama_dir, files, dirs_exist_ok=True)
    (work / "kv.key").write_text(os.urandom(32).hex() + "\n")
    (work / "kv.key").chmod(0o600)
    # the machine's memory with small reserves (as the worker tests), for this unit alone
    (work / "machine.toml").write_text('limit = "unified"\nprofile = "gpu-server"\n')
    base = f"lucia-systest-{RUN_ID}-vllm-cpu:base"  # private: its -tiers is this test's alone
    client.images.get(vllm_cpu_image).tag(base)
    network = f"lucia-systest-{RUN_ID}-kv"
    recipe = work / f"{name}.toml"
    recipe.write_text(_recipe(name, work, base, free_port(), network))
    subprocess.run(["chown", "-R", f"{installation.uid}:{_gid()}", str(work)], check=True)
    as_user(str(installation.source / "install.sh"), "--recipe", str(recipe), timeout=600)
    installed = dataclasses.replace(installation, name=name, recipe=recipe, network=network)
    dropin = installation.home / ".config/systemd/user" / f"{installed.unit}.d"
    as_user("mkdir", "-p", str(dropin))
    as_user("sh", "-c", f"printf '[Service]\\nEnvironment=LUCIA_MACHINE_FILE=%s\\n' "
            f"'{work / 'machine.toml'}' > {dropin}/machine.conf")
    systemctl("daemon-reload")
    systemctl("start", installed.unit)
    try:
        yield Served(installed, work)
    finally:
        systemctl("stop", installed.unit, check=False)
        with contextlib.suppress(docker.errors.NotFound):
            client.containers.get(installed.container).remove(force=True)
        for ref in (tier_image.tag(base), base):
            with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
                client.images.remove(ref, force=True)
        with contextlib.suppress(docker.errors.NotFound):
            client.networks.get(network).remove()
        as_user("rm", "-rf", str(installation.home / ".config/systemd/user" / installed.unit),
                str(dropin), str(installation.share / "recipes" / f"{name}.toml"), check=False)
        systemctl("daemon-reload", check=False)
        shutil.rmtree(installed.engine_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def test_the_service_users_engine_reuses_its_tiers_after_a_restart_a_lost_copy_and_damage(
    served: Served, client: docker.DockerClient
) -> None:
    uid = served.installed.uid
    status = served.request("running")
    container = client.containers.get(served.installed.container)
    assert container.attrs["Config"]["User"] == f"{uid}:{_gid()}"  # the test user's uid and gid
    cold, cold_external = _complete(status["url"])
    assert cold_external == 0.0

    def written() -> bool:  # vLLM's SIGTERM drops the writers' queue: wait for every block
        return all(len(served.blocks(t)) >= FULL_BLOCKS for t in ("nvme", "hdd"))

    wait_until(written, "every block on NVMe and HDD")
    served.request("stopped")
    status = served.request("running")
    assert client.containers.get(served.installed.container).id != container.id
    warm, external = _complete(status["url"])
    print(f"\nafter the restart: {external:.0f} of {len(PROMPT)} prompt tokens from the tiers")
    assert external == FULL_BLOCKS * BLOCK_TOKENS
    assert warm == cold

    # the HDD serves a deleted NVMe copy, and the copy comes back, written by the engine
    on_nvme = {path.name for path in served.blocks("nvme")}
    assert len(on_nvme) == FULL_BLOCKS
    for path in served.blocks("nvme"):
        path.unlink()
    again, total = _complete(status["url"])
    print(f"NVMe copy deleted: {total - external:.0f} prompt tokens from the tiers")
    assert total - external == FULL_BLOCKS * BLOCK_TOKENS
    assert again == cold
    wait_until(lambda: {path.name for path in served.blocks("nvme")} == on_nvme,
               "the NVMe copy back", lambda: f"({len(served.blocks('nvme'))} blocks)")

    # a flipped byte in every block of both tiers: a miss, the cold answer from the same
    # engine, and every damaged block saved again (sealed afresh: other bytes)
    engine_id = client.containers.get(served.installed.container).id
    damaged = [*served.blocks("nvme"), *served.blocks("hdd")]
    assert len(damaged) == 2 * FULL_BLOCKS
    for path in damaged:
        flip_one_byte(path)
    flipped = {path: path.read_bytes() for path in damaged}
    recomputed, _ = _complete(status["url"])
    assert recomputed == cold
    assert client.containers.get(served.installed.container).id == engine_id
    assert (served.installed.status() or {}).get("state") == "running"

    def still_damaged() -> list[Path]:
        return [path for path in flipped if _read(path) in (flipped[path], None)]

    wait_until(lambda: not still_damaged(), "every damaged block saved again",
               lambda: f"({len(still_damaged())} of {len(flipped)} still damaged)")
    served.request("stopped")
    # what the engine wrote is the test user's, owner-only, and the worker removes all of it
    for tier in ("nvme", "hdd"):
        for path in served.tier_files(tier):
            info = path.stat()
            assert (info.st_uid, info.st_mode & 0o777) == (uid, 0o600), path
        root = served.work / f"kv-{tier}"
        as_user("rm", "-r", str(root))
        assert not root.exists()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
