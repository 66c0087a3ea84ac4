"""The installed vLLM engine with KV tiers, as the system tests drive it: install.sh as the test
user, its systemd user unit, the real vLLM CPU server on a private tier image of its own."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import docker
from lucia_kv.tier import NAME as BLOCK_NAME

from supervisor.engines.vllm import tier_image
from tests import http_json
from tests.gguf_fixtures import add_model
from tests.standin import free_port
from tests.system.harness import RUN_ID, USER, Installation, as_user, systemctl, wait_for
from tests.vllm_cpu import BLOCK_TOKENS, PROMPT_SOURCE

PROMPT = [random.Random(2525).randrange(3, 512) for _ in range(2000)]  # token ids, no specials
FULL_BLOCKS = len(PROMPT) // BLOCK_TOKENS
SERVED = "tiny"
START_LIMIT = 1800.0  # the tier image build, then the server's load on a loaded machine


def recipe_text(
    name: str,
    work: Path,
    base: str,
    port: int,
    network: str,
    settings: Mapping[str, str] | None = None,
) -> str:
    """The engine's recipe; `settings` are more of its [settings] (the container's environment)."""
    more = "".join(f'{key} = "{value}"\n' for key, value in (settings or {}).items())
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
models_dir = "{work / "models"}"
guid = "tiny-llama"
[tiers]
nvme = {{ path = "{work / "kv-nvme"}", max_bytes = "64m" }}
hdd = {{ path = "{work / "kv-hdd"}", max_bytes = "256m" }}
key_secret = "LUCIA_KV_KEY"
[secrets]
LUCIA_KV_KEY = "{work / "kv.key"}"
[settings]
HF_HUB_OFFLINE = 1
{more}[run]
network = "{network}"
port = {port}
ready_path = "/health"
metrics_path = "/metrics"
ready_timeout = 900
stop_grace = 60
shm_size = "512m"
memory = "3g"
"""


def gid() -> int:
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
                desired,
                "failed",
            )
            return status if done else None

        status: dict[str, Any] = wait_for(settled, START_LIMIT, f"{desired} or failed")
        assert status["state"] == desired, status.get("message")
        return status

    def tier_files(self, tier: str) -> list[Path]:
        """Every file the engine left in a tier (blocks, the owner lock), temp files aside."""
        return sorted(
            p
            for p in (self.work / f"kv-{tier}").rglob("*")
            if p.is_file() and not p.name.startswith(".tmp-")
        )

    def blocks(self, tier: str) -> list[Path]:
        return [p for p in self.tier_files(tier) if BLOCK_NAME.fullmatch(p.name)]


def complete(url: str, prompt: list[int] = PROMPT) -> tuple[tuple[int, ...], float]:
    """The answer's token ids, and the prompt tokens the server says came from the tiers."""
    answer = http_json.post(
        url + "/v1/completions",
        {
            "model": SERVED,
            "prompt": prompt,
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=600,
    )
    assert answer.status == 200, answer.body[-2000:]
    (choice,) = answer.json()["choices"]
    metrics = http_json.get(url + "/metrics", 30).body.decode()
    external = sum(
        float(m.group(2))
        for m in PROMPT_SOURCE.finditer(metrics)
        if m.group(1) == "external_kv_transfer"
    )
    return tuple(choice["token_ids"]), external


@contextlib.contextmanager
def installed_engine(
    installation: Installation,
    client: docker.DockerClient,
    vllm_cpu_image: str,
    tiny_llama_dir: Path,
    label: str = "kv",
    settings: Mapping[str, str] | None = None,
    prepare: Callable[[Path], AbstractContextManager[object]] | None = None,
) -> Iterator[Served]:
    """The engine installed as the test user and its unit started. `prepare(work)` is entered
    before install.sh (a disk of the test's own mounted in the work directory) and left before
    the work directory is removed."""
    name = f"{label}{RUN_ID}"
    work = installation.home / f"lucia-system-test-{RUN_ID}-{label}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    files = add_model(work / "models", "Ready", guid="tiny-llama")
    shutil.copytree(tiny_llama_dir, files, dirs_exist_ok=True)
    (work / "kv.key").write_text(os.urandom(32).hex() + "\n")
    (work / "kv.key").chmod(0o600)
    # the machine's memory with small reserves (as the worker tests), for this unit alone
    (work / "machine.toml").write_text('limit = "unified"\nprofile = "gpu-server"\n')
    # private: its -tiers is this test's alone
    base = f"lucia-systest-{RUN_ID}-{label}-vllm-cpu:base"
    client.images.get(vllm_cpu_image).tag(base)
    network = f"lucia-systest-{RUN_ID}-{label}"
    recipe = work / f"{name}.toml"
    recipe.write_text(recipe_text(name, work, base, free_port(), network, settings))
    stack = contextlib.ExitStack()
    if prepare is not None:
        stack.enter_context(prepare(work))
    subprocess.run(["chown", "-R", f"{installation.uid}:{gid()}", str(work)], check=True)
    as_user(str(installation.source / "install.sh"), "--recipe", str(recipe), timeout=600)
    installed = dataclasses.replace(installation, name=name, recipe=recipe, network=network)
    dropin = installation.home / ".config/systemd/user" / f"{installed.unit}.d"
    as_user("mkdir", "-p", str(dropin))
    as_user(
        "sh",
        "-c",
        f"printf '[Service]\\nEnvironment=LUCIA_MACHINE_FILE=%s\\n' "
        f"'{work / 'machine.toml'}' > {dropin}/machine.conf",
    )
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
        as_user(
            "rm",
            "-rf",
            str(installation.home / ".config/systemd/user" / installed.unit),
            str(dropin),
            str(installation.share / "recipes" / f"{name}.toml"),
            check=False,
        )
        systemctl("daemon-reload", check=False)
        shutil.rmtree(installed.engine_dir, ignore_errors=True)
        stack.close()
        shutil.rmtree(work, ignore_errors=True)
