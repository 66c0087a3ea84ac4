"""The KV tiers' disks misbehave under the installed engine, and it serves on.

install.sh as the test user, its systemd user unit, the real vLLM 0.32.0 CPU server on the tier
image; the NVMe tier is an ext4 of the test's own on a loop device (mounted errors=remount-ro,
as a data disk is), the HDD tier a directory. One engine meets, in turn: a restart whose index
rebuild has no time at all (rebuild_max_seconds 0), a truncated block, a disk that something
else filled, an ext4 error that remounts the disk read-only, and the HDD tier's directory
removed. After each the same engine answers the prompt as it did cold, and the worker's status
says which tier is off and why. The table of what happened is printed.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from pathlib import Path

import docker
import pytest

from tests.loop_disk import ext4, fs_error
from tests.system.harness import Installation, as_user
from tests.system.vllm_tiers import FULL_BLOCKS, Served, complete, installed_engine
from tests.vllm_cpu import wait_for as wait_until

pytestmark = pytest.mark.system

OTHER = [random.Random(77).randrange(3, 512) for _ in range(2000)]
THIRD = [random.Random(78).randrange(3, 512) for _ in range(2000)]
SETTINGS = {"LUCIA_KV_REBUILD_MAX_SECONDS": "0", "LUCIA_KV_RETRY_SECONDS": "1"}


@contextlib.contextmanager
def nvme_disk(mount: Path, image: Path) -> Iterator[Path]:
    """A 96 MiB ext4 mounted at `mount` errors=remount-ro, owner-only (install.sh's chown makes
    it the test user's)."""
    with ext4(mount, image, 96 * 2**20, "errors=remount-ro"):
        (mount / "lost+found").rmdir()
        mount.chmod(0o700)
        yield mount


@pytest.fixture(scope="module")
def engine(
    installation: Installation,
    client: docker.DockerClient,
    vllm_cpu_image: str,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    if os.geteuid() != 0:
        pytest.skip("a loop device for the NVMe tier needs root")
    image = tmp_path_factory.mktemp("nvme-disk") / "nvme.img"
    with installed_engine(
        installation,
        client,
        vllm_cpu_image,
        tiny_llama_dir,
        label="kvfault",
        settings=SETTINGS,
        prepare=lambda work: nvme_disk(work / "kv-nvme", image),
    ) as served:
        yield served


def test_the_engine_serves_on_through_every_fault_of_its_tiers(
    engine: Served, client: docker.DockerClient
) -> None:
    table: list[str] = []
    status = engine.request("running")
    url = status["url"]
    cold, _ = complete(url)

    def written() -> bool:
        return all(len(engine.blocks(t)) >= FULL_BLOCKS for t in ("nvme", "hdd"))

    wait_until(written, "every block on NVMe and HDD")

    def container_id() -> str:
        return str(client.containers.get(engine.installed.container).id)

    def serving(what: str, prompt: list[int] | None = None) -> tuple[tuple[int, ...], float]:
        """The engine answers, is still running, and (for the first prompt) as it did cold."""
        answer, external = complete(url, prompt) if prompt is not None else complete(url)
        now = engine.installed.status() or {}
        assert now.get("state") == "running", (what, now.get("message"))
        if prompt is None:
            assert answer == cold, what
        return answer, external

    def says(words: str) -> str:
        """The status message once it says `words` (the worker reads the engine's /metrics
        every 10 s; the plugin's counts go with the engine's next step)."""

        def message() -> str:
            return str((engine.installed.status() or {}).get("message", ""))

        wait_until(lambda: words in message(), f"the status to say {words!r}", message)
        return message()

    # 1. a restart whose rebuild has no time: every block stays, indexed while it serves
    before = {t: {p.name for p in engine.blocks(t)} for t in ("nvme", "hdd")}
    engine.request("stopped")
    status = engine.request("running")
    url = status["url"]
    engine_id = container_id()
    _, external = serving("after a restart with a rebuild deadline of 0")
    after = {t: {p.name for p in engine.blocks(t)} for t in ("nvme", "hdd")}
    assert all(before[t] <= after[t] for t in before), "a valid block was deleted"
    table.append(
        f"rebuild deadline 0 | served, {external:.0f} prompt tokens from the tiers, "
        f"{sum(len(before[t] - after[t]) for t in before)} blocks deleted"
    )

    # 2. a truncated block: removed, the answer recomputed or read from the HDD, saved again
    victim = engine.blocks("nvme")[0]
    whole = victim.stat().st_size
    os.truncate(victim, whole // 2)
    serving("a truncated block")
    wait_until(
        lambda: victim.exists() and victim.stat().st_size == whole,
        "the truncated block saved again",
    )
    assert container_id() == engine_id
    table.append("a block truncated | served, the block removed and saved again")

    # 3. something else fills the NVMe disk: the tier fits itself to what it holds
    mount = engine.work / "kv-nvme"
    filler = mount / "filler.bin"
    with filler.open("wb") as handle, contextlib.suppress(OSError):
        while True:
            handle.write(b"\1" * 2**20)
            handle.flush()
    first, _ = serving("a full disk", OTHER)
    wait_until(
        lambda: len({p.name for p in engine.blocks("nvme")} - after["nvme"]) > 0,
        "a block of the new prompt on the full disk",
    )
    again, _ = serving("a full disk, the prompt again", OTHER)
    assert again == first
    assert container_id() == engine_id
    filler.unlink()
    table.append("disk filled by another | served, LRU blocks evicted, new blocks written")

    # 4. an ext4 error: the disk is read-only; the tier goes off, the HDD serves on
    fs_error(mount)
    serving("the NVMe disk read-only")
    message = says("tier nvme off: read-only file system")
    assert container_id() == engine_id
    table.append(f"NVMe remounted read-only | served; status: {message}")

    # 5. the HDD tier's directory removed under the running engine
    for space in (engine.work / "kv-hdd").iterdir():
        as_user("rm", "-r", str(space))
    serving("the HDD directory removed", THIRD)
    serving("the HDD directory removed, the first prompt")
    message = says("tier hdd off: no such file or directory")
    assert container_id() == engine_id
    table.append(f"HDD directory removed | served; status: {message}")
    print("\nfault | what the engine did\n" + "\n".join(table))
