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

from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from tests.kv.support import flip_one_byte
from tests.system.harness import Installation, as_user
from tests.system.vllm_tiers import (
    FULL_BLOCKS,
    PROMPT,
    Served,
    complete,
    gid,
    installed_engine,
)
from tests.vllm_cpu import BLOCK_TOKENS
from tests.vllm_cpu import wait_for as wait_until

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def served(
    installation: Installation,
    client: docker.DockerClient,
    vllm_cpu_image: str,
    tiny_llama_dir: Path,
) -> Iterator[Served]:
    with installed_engine(installation, client, vllm_cpu_image, tiny_llama_dir) as engine:
        yield engine


def test_the_service_users_engine_reuses_its_tiers_after_a_restart_a_lost_copy_and_damage(
    served: Served, client: docker.DockerClient
) -> None:
    uid = served.installed.uid
    status = served.request("running")
    container = client.containers.get(served.installed.container)
    assert container.attrs["Config"]["User"] == f"{uid}:{gid()}"  # the test user's uid and gid
    cold, cold_external = complete(status["url"])
    assert cold_external == 0.0

    def written() -> bool:  # vLLM's SIGTERM drops the writers' queue: wait for every block
        return all(len(served.blocks(t)) >= FULL_BLOCKS for t in ("nvme", "hdd"))

    wait_until(written, "every block on NVMe and HDD")
    served.request("stopped")
    status = served.request("running")
    assert client.containers.get(served.installed.container).id != container.id
    warm, external = complete(status["url"])
    print(f"\nafter the restart: {external:.0f} of {len(PROMPT)} prompt tokens from the tiers")
    assert external == FULL_BLOCKS * BLOCK_TOKENS
    assert warm == cold

    # the HDD serves a deleted NVMe copy, and the copy comes back, written by the engine
    on_nvme = {path.name for path in served.blocks("nvme")}
    assert len(on_nvme) == FULL_BLOCKS
    for path in served.blocks("nvme"):
        path.unlink()
    again, total = complete(status["url"])
    print(f"NVMe copy deleted: {total - external:.0f} prompt tokens from the tiers")
    assert total - external == FULL_BLOCKS * BLOCK_TOKENS
    assert again == cold
    wait_until(
        lambda: {path.name for path in served.blocks("nvme")} == on_nvme,
        "the NVMe copy back",
        lambda: f"({len(served.blocks('nvme'))} blocks)",
    )

    # a flipped byte in every block of both tiers: a miss, the cold answer from the same
    # engine, and every damaged block saved again (sealed afresh: other bytes)
    engine_id = client.containers.get(served.installed.container).id
    damaged = [*served.blocks("nvme"), *served.blocks("hdd")]
    assert len(damaged) == 2 * FULL_BLOCKS
    for path in damaged:
        flip_one_byte(path)
    flipped = {path: path.read_bytes() for path in damaged}
    recomputed, _ = complete(status["url"])
    assert recomputed == cold
    assert client.containers.get(served.installed.container).id == engine_id
    assert (served.installed.status() or {}).get("state") == "running"

    def still_damaged() -> list[Path]:
        return [path for path in flipped if _read(path) in (flipped[path], None)]

    wait_until(
        lambda: not still_damaged(),
        "every damaged block saved again",
        lambda: f"({len(still_damaged())} of {len(flipped)} still damaged)",
    )
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
