"""Two vllm engines on one pair of tier roots, started together (a boot with `enable --now`, a
gateway's swap): the one whose directories come second prunes, and the other's namespace
survives it while that engine is between its Check and its container, while its container
exists but vLLM has not yet locked its store, and goes once that container is gone."""

from __future__ import annotations

import os
from pathlib import Path

from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Container, RunSpec
from supervisor.engines.base import Endpoint
from supervisor.engines.look import Look
from supervisor.engines.vllm.engine import NAMESPACE_LABEL, Vllm
from supervisor.engines.vllm.steps import TierDirectories
from supervisor.worker import claims
from tests.unit.test_vllm_tier_wiring import KEY, Images, base_images, ctx, parsed, recipe_text

KEY_B = "b" * 64
TIERS = ("nvme", "hdd")


class Containers(Images):
    """The images, and containers by label as Docker lists them (created ones too)."""

    def __init__(self) -> None:
        super().__init__(base_images())
        self.made: dict[str, Container] = {}

    def containers(self, label: str | list[str], running: bool = True) -> list[Container]:
        assert label == NAMESPACE_LABEL
        return [
            found
            for found in self.made.values()
            if label in found.labels and (found.running or not running)
        ]

    def create(self, spec: RunSpec, status: str) -> str:
        self.made[spec.name] = Container(
            f"id-{spec.name}", spec.name, spec.image, status, 0, False, "", dict(spec.labels), ()
        )
        return f"id-{spec.name}"


def tiered(tmp: Path, name: str, key: str, runtime: Runtime) -> Vllm:
    """An engine of its own name, key and state on the tier roots under tmp."""
    home = tmp / name
    (home / "library" / "g1" / "files").mkdir(parents=True)
    (home / "kv.key").write_text(key + "\n")
    (home / "kv.key").chmod(0o600)
    text = recipe_text(home).replace(str(home / "nvme"), str(tmp / "nvme"))
    text = text.replace(str(home / "hdd"), str(tmp / "hdd")).replace('"c"', f'"{name}"', 1)
    return Vllm(name, parsed(text), runtime, home / "state")


def prepared(engine: Vllm) -> RunSpec:
    """Its prerequisites made (the tier image, its directories): the spec it starts."""
    for _ in range(3):
        for step in engine.prerequisites().missing:
            engine.make(step, ctx())
    ready = engine.prerequisites()
    assert ready.missing == () and ready.image is not None
    endpoint = Endpoint("172.17.0.1", 8123)
    spec = engine.run_spec(ready.image, endpoint)
    engine.last = Look(None, endpoint, (), spec, ready)  # as its observation keeps it
    return spec


def blocks(tmp: Path, space: str) -> dict[str, bool]:
    return {tier: (tmp / tier / space / "block").exists() for tier in TIERS}


def test_a_namespace_whose_engine_is_starting_survives_the_other_engines_prune(
    tmp_path: Path,
) -> None:
    runtime = Containers()
    a, b = tiered(tmp_path, "a", KEY, runtime), tiered(tmp_path, "b", KEY_B, runtime)
    spec_a = prepared(a)
    space_a = spec_a.labels[NAMESPACE_LABEL]
    for tier in TIERS:  # blocks of A's last run: an old namespace's bytes to a prune
        (tmp_path / tier / space_a / "block").write_bytes(os.urandom(8192))
    a.check_more(spec_a, ctx())  # A's Check passed: its start is next
    spec_b = prepared(b)  # B's directories, then its prune, which wants every old byte gone
    space_b = spec_b.labels[NAMESPACE_LABEL]
    assert space_b != space_a
    assert blocks(tmp_path, space_a) == {"nvme": True, "hdd": True}, "B pruned A's start"
    # A's container exists (created, vLLM loading: no store lock yet); A lets go of its hold
    claims.started(a, runtime.create(spec_a, "created"))
    b.check_more(spec_b, ctx())
    claims.started(b, runtime.create(spec_b, "running"))  # B's prune, after its start
    assert blocks(tmp_path, space_a) == {"nvme": True, "hdd": True}, "B pruned A's container's"
    # A's container is gone: its namespace is an old one, and B's next prune takes it
    del runtime.made[spec_a.name]
    b.make(TierDirectories(space_b), ctx())
    assert blocks(tmp_path, space_a) == {"nvme": False, "hdd": False}
    assert all(os.listdir(tmp_path / tier) == [space_b] for tier in TIERS)


def test_a_start_abandoned_lets_its_namespace_go(tmp_path: Path) -> None:
    runtime = Containers()
    a, b = tiered(tmp_path, "a", KEY, runtime), tiered(tmp_path, "b", KEY_B, runtime)
    spec_a = prepared(a)
    space_a = spec_a.labels[NAMESPACE_LABEL]
    (tmp_path / "nvme" / space_a / "block").write_bytes(os.urandom(8192))
    a.check_more(spec_a, ctx())
    space_b = prepared(b).labels[NAMESPACE_LABEL]
    assert (tmp_path / "nvme" / space_a / "block").exists()
    claims.abandoned(a, None)  # a stop came first: A will not start
    b.make(TierDirectories(space_b), ctx())
    assert not (tmp_path / "nvme" / space_a).exists()
