"""A small ext4 of a test's own on a loop device (root only): a real disk that fills, and that
an error remounts read-only."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def ext4(mount: Path, image: Path, size: int, options: str = "defaults") -> Iterator[str]:
    """An ext4 of `size` bytes in `image` on a loop device, mounted at `mount` (made) with
    `options`; its device. Unmounted, detached and its image removed on leaving."""
    mount.mkdir(exist_ok=True)
    with image.open("wb") as handle:
        handle.truncate(size)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    device = subprocess.run(
        ["losetup", "--find", "--show", str(image)], check=True, capture_output=True, text=True
    ).stdout.strip()
    try:
        subprocess.run(["mount", "-o", options, device, str(mount)], check=True)
        yield device
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        subprocess.run(["losetup", "-d", device], check=False)
        image.unlink(missing_ok=True)


def fs_error(mount: Path) -> None:
    """An ext4 error at `mount`, as an I/O error under it makes one: mounted
    errors=remount-ro, the kernel remounts it read-only."""
    device = subprocess.run(
        ["findmnt", "-n", "-o", "SOURCE", str(mount)], check=True, capture_output=True, text=True
    ).stdout.strip()
    Path(f"/sys/fs/ext4/{Path(device).name}/trigger_fs_error").write_text("lucia test\n")


def remount(mount: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(mount)], check=True)
