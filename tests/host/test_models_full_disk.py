"""A small disk (a 1 MiB tmpfs, or a 2 MiB ext4 on a loop device, mounted as root): a model
that cannot fit is refused at once, naming the bytes; a disk that fills during the download
fails it, harming nothing else."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.host.models import manifest as mf
from supervisor.host.models.control import RequestRefused
from tests.gguf_fixtures import write_gguf
from tests.host.library_world import (
    GGUF,
    REPO,
    hub_of,
    queue,
    running,
    wait_for,
    wait_state,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small disk needs root")


@pytest.fixture(params=["tmpfs", "loop"])
def small(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A small file system: a 1 MiB tmpfs, or a 2 MiB ext4 on a loop device."""
    mount = tmp_path / "small"
    mount.mkdir()
    device = None
    if request.param == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    else:
        image = tmp_path / "disk.img"
        with image.open("wb") as handle:
            handle.truncate(2 * 2**20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
        device = subprocess.run(
            ["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True
        ).stdout.strip()
        subprocess.run(["mount", device, str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)
        if device is not None:
            subprocess.run(["losetup", "-d", device], check=False)


def test_a_model_that_cannot_fit_is_refused_at_once(small: Path, tmp_path: Path) -> None:
    write_gguf(tmp_path / "repo" / GGUF, elements=400_000)  # 1.6 MB
    needed = (tmp_path / "repo" / GGUF).stat().st_size
    root = small / "models"
    with hub_of(tmp_path / "repo") as hub, pytest.raises(RequestRefused) as refused:
        queue(root, hub)
    free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
    assert str(refused.value) == (
        f"{REPO}: not enough disk space: it needs {needed} bytes more and {free} bytes are free"
    )
    assert mf.load_all(root) == []


def test_a_disk_filled_during_the_download_fails_it_and_harms_nothing_else(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_gguf(tmp_path / "repo" / GGUF, elements=150_000)  # 600 kB
    root = small / "models"
    other = small / "other.bin"
    with hub_of(tmp_path / "repo", slow=True, chunk=65536) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        queued = queue(root, hub)
        with running(root):
            wait_for("the hf child", lambda: mf.load(root, queued.id).pid)
            free = os.statvfs(small).f_bavail * os.statvfs(small).f_frsize
            other.write_bytes(b"\1" * (free - 64 * 1024))  # someone else fills the disk
            model = wait_state(root, queued.id, "Failed", "Ready")
    assert model.state == "Failed"
    assert model.message.startswith(
        "the disk filled during the download: not enough disk space: it needs "
    ), model.message
    assert not list((root / queued.id / "files").rglob("*.incomplete"))
    assert other.read_bytes() == b"\1" * (free - 64 * 1024)
