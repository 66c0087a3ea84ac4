"""Two real vLLM 0.32.0 CPU engines, each through its own worker, on one pair of tier roots.

First, with no engine: a container that carries a namespace's label (created, never started)
keeps that namespace from a prune through the real Docker listing, and once it is removed the
namespace goes.

Engine A (a vllm-cpu recipe with NVMe and HDD tiers on the shared roots, `prefix_caching =
false`) answers a 2000-token prompt and its blocks go to its namespace on both tiers. Then, in
this order, each leaving what the next needs:
- engine C, A's recipe with only its name and port changed (so A's namespace), is refused by
  the owner lock A's store holds: `failed`, the message naming A's container; A serves on;
- engine B, A's recipe with another cache key (another namespace) and caps of 4 MiB, starts on
  the same roots: its prune wants every byte of other namespaces gone (it promises B its whole
  cap), yet A's namespace and every block of it stay, since A's container names it and A's store
  holds its lock; A then answers the prompt from its tiers;
- once A is stopped (its container removed, its lock released), a prune for B on the same roots,
  listing the real containers, removes A's namespace.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import pytest

from supervisor.docker.runtime import Runtime
from supervisor.engines.vllm import namespaces, tier_image
from supervisor.recipe.schema import parse_bytes
from tests import http_json
from tests.fixtures import REPO_TEMPLATE, RUN_ID, TEST_LABEL, Engine, _repo
from tests.gguf_fixtures import add_model
from tests.integration.test_kv_tiers_worker import (
    BLOCK_NAME,
    FULL_BLOCKS,
    METRICS_TARGET,
    PROMPT,
    START_LIMIT,
    Answer,
    TieredEngine,
)
from tests.standin import free_port, toml_text
from tests.vllm_cpu import wait_for

pytestmark = pytest.mark.docker

TIERS = ("nvme", "hdd")
CAPS = {"nvme": "64m", "hdd": "256m"}  # A's: room for the prompt's blocks on both tiers
SMALL = "4m"  # B's cap on each tier: below what A's namespace holds there
HOLDER = "in use by another KV-cache store"  # lucia_kv.owner.Taken's words


def block_names(directory: Path) -> set[str]:
    """The block files of one namespace directory (not temp files, not the owner lock)."""
    try:
        return {path.name for path in directory.iterdir() if BLOCK_NAME.fullmatch(path.name)}
    except FileNotFoundError:
        return set()


def held_bytes(directory: Path) -> int:
    """What a namespace directory holds on disk, as prune counts it (allocated bytes)."""
    return sum(
        path.lstat().st_blocks * 512
        for path in directory.rglob("*")
        if not stat.S_ISDIR(path.lstat().st_mode)
    )


def variant(text: str, engine: Engine, **tables: dict[str, Any]) -> str:
    """A's recipe for another engine: its name and port, and these tables' keys replaced (a key
    given None is left out)."""
    data = tomllib.loads(text)
    data["name"] = engine.name
    data["run"]["port"] = engine.port
    for table, keys in tables.items():
        merged = {**data.get(table, {}), **keys}
        data[table] = {key: value for key, value in merged.items() if value is not None}
    return toml_text(data)


Maker = Callable[[str, Callable[[Engine], str]], Engine]


@dataclass
class Shared:
    a: TieredEngine
    roots: dict[str, Path]  # the tier roots every engine here names
    space: str  # A's namespace
    cold: Answer  # A's answer to PROMPT, computed
    blocks: dict[str, set[str]]  # A's block files of PROMPT, per tier
    lock_line: str  # A's owner lock: the holder line of its store
    make: Maker  # (name suffix, its recipe from its Engine) -> the Engine, its worker started
    root: Path
    space_b: str = ""  # B's namespace, once B runs

    def dirs(self, space: str) -> dict[str, Path]:
        return {tier: self.roots[tier] / space for tier in TIERS}


@pytest.fixture(scope="module")
def shared(
    client: docker.DockerClient,
    vllm_cpu_image: str,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Shared]:
    root = tmp_path_factory.mktemp("kv-shared-root")
    repository = f"lucia-test-{RUN_ID}-vllm-cpu-shared"  # private: the tier image is its -tiers
    client.images.get(vllm_cpu_image).tag(repository, "base")
    base_ref = f"{repository}:base"
    image = tier_image.tag(base_ref)
    key = root / "kv-a.key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    machine = root / "machine.toml"  # the machine's memory, a small reserve (as make_engine)
    machine.write_text('limit = "unified"\nprofile = "gpu-server"\n')
    repo = _repo(REPO_TEMPLATE, root / "recipe-repo")
    roots = {tier: root / f"kv-{tier}" for tier in TIERS}  # shared by every engine
    name = f"t{RUN_ID}-share-a"
    (root / name).mkdir()
    files = add_model(root / name / "library", "Ready")
    shutil.copytree(tiny_llama_dir, files, dirs_exist_ok=True)
    metrics_dir = root / name / "kv-metrics"
    metrics_dir.mkdir(mode=0o700)
    engine = Engine(
        name=name,
        repo=repo,
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
            "max_model_len": 2048,
            "prefix_caching": False,
            "args": ["--dtype", "bfloat16", "--enforce-eager"],
        },
        tiers_extra={tier: {"path": str(roots[tier]), "max_bytes": CAPS[tier]} for tier in TIERS},
    )
    a = TieredEngine(
        engine, client, key.read_text().strip(), roots, image, metrics_dir / "lucia_kv.prom"
    )
    made = [engine]

    def make(suffix: str, recipe: Callable[[Engine], str]) -> Engine:
        other = Engine(
            name=f"t{RUN_ID}-share-{suffix}",
            repo=repo,
            base="",
            root=root / f"t{RUN_ID}-share-{suffix}",
            kind="vllm",
            vllm_device="cpu",
            port=free_port(),
            env={"LUCIA_MACHINE_FILE": str(machine)},
        )
        other.root.mkdir()
        other.recipe_text = recipe(other)
        made.append(other)
        other.start_worker()
        return other

    try:
        engine.start_worker()
        a.start()
        space = a.namespace
        cold = a.complete(PROMPT)
        dirs = {tier: roots[tier] / space for tier in TIERS}
        wait_for(
            lambda: all(len(block_names(d)) >= FULL_BLOCKS for d in dirs.values()),
            "every block of A's prompt on NVMe and HDD",
            lambda: str({t: len(block_names(d)) for t, d in dirs.items()}),
        )
        yield Shared(
            a,
            roots,
            space,
            cold,
            {t: block_names(d) for t, d in dirs.items()},
            (dirs["nvme"] / namespaces.OWNER_LOCK).read_text(),
            make,
            root,
        )
    finally:
        for each in made:
            discard(client, each)
        for ref in (image, base_ref):
            with contextlib.suppress(docker.errors.ImageNotFound, docker.errors.APIError):
                client.images.remove(ref)


def discard(client: docker.DockerClient, engine: Engine) -> None:
    """Its workers ended, its container removed."""
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


def test_a_namespace_a_created_container_names_is_kept_until_the_container_goes(
    client: docker.DockerClient, base_image: str, tmp_path: Path
) -> None:
    root = tmp_path / "nvme"
    current, labelled = "c" * 32, os.urandom(16).hex()
    for space in (current, labelled):
        (root / space).mkdir(mode=0o700, parents=True)
        (root / space / "block").write_bytes(os.urandom(8192))
    made = client.containers.create(
        base_image,
        ["true"],
        name=f"lucia-test-{RUN_ID}-kv-label",
        labels={TEST_LABEL: RUN_ID, namespaces.LABEL: labelled},
    )
    try:
        listed = namespaces.named(Runtime())
        assert labelled in listed  # a container never started still names its namespace
        gone = namespaces.prune(root, current, 4096, 4096, lambda: namespaces.named(Runtime()))
        assert gone == [] and (root / labelled / "block").exists()
    finally:
        made.remove(force=True)
    gone = namespaces.prune(root, current, 4096, 4096, lambda: namespaces.named(Runtime()))
    assert gone == [root / labelled]


def a_serves(shared: Shared, container_id: str) -> None:
    """A is running in the same container and answers its health check."""
    status = shared.a.engine.status()
    assert status is not None and status["state"] == "running", status
    assert shared.a.container().id == container_id
    assert http_json.get(shared.a.url + "/health", 30).status == 200


def test_an_engine_of_the_same_namespace_is_refused_naming_the_holder_and_a_serves_on(
    shared: Shared,
) -> None:
    first = shared.a.container().id
    assert shared.lock_line.endswith(f" in container {first[:12]}\n"), shared.lock_line  # A's
    text = shared.a.engine.recipe_path.read_text()
    c = shared.make("c", lambda engine: variant(text, engine))
    generation = c.request("running")
    status = c.wait_status(
        lambda s: s["generation"] == generation and s["state"] in ("failed", "running"),
        START_LIMIT,
        "C failed or running",
    )
    print(f"\nC's status: {status['state']}: {status['message']}")
    assert status["state"] == "failed", status
    assert HOLDER in status["message"], status["message"]
    assert shared.lock_line.strip() in status["message"]  # the holder: A's pid, host, container
    a_serves(shared, first)
    for tier, directory in shared.dirs(shared.space).items():
        assert shared.blocks[tier] <= block_names(directory), tier
    assert all([p.name for p in root.iterdir()] == [shared.space] for root in shared.roots.values())
    discard(shared.a.client, c)


def test_another_namespaces_start_on_the_root_leaves_a_held_one_whole_and_a_reads_it(
    shared: Shared,
) -> None:
    first = shared.a.container().id
    a_dirs = shared.dirs(shared.space)
    held = {tier: held_bytes(directory) for tier, directory in a_dirs.items()}
    # prune promises B its whole cap (reserve = cap): reserve + any byte of another namespace
    # is over the cap, so it wants every byte of A's namespace gone
    assert min(held.values()) > 0, held
    key_b = shared.root / "kv-b.key"
    key_b.write_text(os.urandom(32).hex() + "\n")
    key_b.chmod(0o600)
    text = shared.a.engine.recipe_path.read_text()
    b = TieredEngine(
        shared.make(
            "b",
            lambda engine: variant(
                text,
                engine,
                secrets={"LUCIA_KV_KEY": str(key_b)},
                settings={"LUCIA_KV_METRICS_FILE": None},
                run={"volumes": None},  # A's stay A's
                tiers={
                    tier: {"path": str(shared.roots[tier]), "max_bytes": SMALL} for tier in TIERS
                },
            ),
        ),
        shared.a.client,
        key_b.read_text().strip(),
        shared.roots,
        shared.a.image,
        shared.root / "b-has-no-metrics-file",
    )
    b.start()
    assert b.namespace != shared.space
    assert all((root / b.namespace).is_dir() for root in shared.roots.values())
    for tier, directory in a_dirs.items():
        assert directory.is_dir(), f"B's start removed A's {tier} namespace {directory}"
        # (A's worker makes its namespace directory again, empty, when it is gone)
        assert shared.blocks[tier] <= block_names(directory), f"A's {tier} blocks are gone"
        assert (directory / namespaces.OWNER_LOCK).read_text() == shared.lock_line
    assert b"old KV-cache namespace removed" not in b.worker_output()
    print(f"\nB on the same roots (caps {SMALL}): A's namespace kept, {held} bytes held")
    assert len(b.complete([5, 6, 7, 8] * 40, max_tokens=4).token_ids) == 4
    a_serves(shared, first)
    before = shared.a.by_source().get("external_kv_transfer", 0.0)
    hits = shared.a.counter("hits", "nvme")
    answer = shared.a.complete(PROMPT)
    external = shared.a.by_source().get("external_kv_transfer", 0.0) - before
    print(f"A beside B: {external:.0f} of {len(PROMPT)} prompt tokens from its tiers")
    assert external >= 0.9 * len(PROMPT)
    assert answer.token_ids == shared.cold.token_ids
    wait_for(
        lambda: shared.a.counter("hits", "nvme") - hits >= FULL_BLOCKS,
        "A's NVMe hits",
        lambda: str(shared.a.counters()),
    )
    shared.space_b = b.namespace


def test_once_a_is_stopped_a_prune_for_b_removes_as_namespace(shared: Shared) -> None:
    space_b = shared.space_b
    assert space_b, "B ran (the test before)"
    shared.a.stop()
    small = int(str(parse_bytes(SMALL)))
    for tier, root in shared.roots.items():
        gone = namespaces.prune(root, space_b, small, small, lambda: namespaces.named(Runtime()))
        assert gone == [root / shared.space], (tier, gone)
        assert sorted(p.name for p in root.iterdir()) == [space_b]
