"""Block files: atomic, owner-only, direct I/O with a clean fallback, no torn block after a
process is killed at any step of a write."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from lucia_kv import blockfile
from lucia_kv.config import TierSpec
from lucia_kv.tier import Tier, TierError

from tests.kv import crash_child
from tests.kv.support import payload

ROOT = Path(__file__).resolve().parents[2]


def open_dir(path: Path) -> int:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY)


@pytest.mark.parametrize("size", [0, 1, 4088, 4089, 100_000])
def test_round_trip_sizes_and_alignment(tmp_path: Path, size: int) -> None:
    fd = open_dir(tmp_path / "t")
    try:
        data = payload(1, size)
        written, direct = blockfile.write(fd, "a" * 64, data, direct=True)
        assert written % blockfile.ALIGN == 0 and written == blockfile.disk_size(size)
        assert direct  # ext4 takes O_DIRECT
        assert blockfile.read(fd, "a" * 64, direct=True) == data
        info = os.stat("a" * 64, dir_fd=fd)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert os.listdir(fd) == ["a" * 64]
    finally:
        os.close(fd)


def test_falls_back_where_o_direct_is_refused(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def refusing(path, flags, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    fd = open_dir(tmp_path / "t")
    monkeypatch.setattr(os, "open", refusing)
    try:
        _written, direct = blockfile.write(fd, "b" * 64, b"hello", direct=True)
        assert not direct
        assert blockfile.read(fd, "b" * 64, direct=True) == b"hello"
    finally:
        monkeypatch.undo()
        os.close(fd)


def test_read_with_hands_over_the_payload_only_while_use_runs(tmp_path: Path) -> None:
    fd = open_dir(tmp_path / "t")
    try:
        blockfile.write(fd, "e" * 64, payload(3, 10_000), direct=True)
        seen: list[bytes] = []

        def use(view: memoryview) -> memoryview:
            seen.append(bytes(view))
            return view

        kept = blockfile.read_with(fd, "e" * 64, True, use)
        assert seen == [payload(3, 10_000)]
        with pytest.raises(ValueError, match="released"):
            bytes(kept)  # the buffer is reused by the next read: no view of it outlives use
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("length", "error"), [(None, blockfile.Missing), (5000, blockfile.Short), (3, blockfile.Short)]
)
def test_read_with_never_hands_over_a_missing_or_short_payload(
    tmp_path: Path, length: int | None, error: type[Exception]
) -> None:
    fd = open_dir(tmp_path / "t")
    try:
        if length is not None:
            blockfile.write(fd, "f" * 64, payload(4, 10_000), direct=True)
            os.truncate(tmp_path / "t" / ("f" * 64), length)
        used: list[int] = []
        with pytest.raises(error):
            blockfile.read_with(fd, "f" * 64, True, lambda view: used.append(len(view)))
        assert used == []
    finally:
        os.close(fd)


def test_missing_and_short_files(tmp_path: Path) -> None:
    fd = open_dir(tmp_path / "t")
    try:
        with pytest.raises(blockfile.Missing):
            blockfile.read(fd, "c" * 64, direct=True)
        blockfile.write(fd, "c" * 64, payload(2, 10_000), direct=True)
        os.truncate(tmp_path / "t" / ("c" * 64), 5000)
        with pytest.raises(blockfile.Short):
            blockfile.read(fd, "c" * 64, direct=True)
        os.truncate(tmp_path / "t" / ("c" * 64), 3)
        with pytest.raises(blockfile.Short):
            blockfile.read(fd, "c" * 64, direct=True)
    finally:
        os.close(fd)


@pytest.mark.parametrize("step", blockfile.STEPS)
def test_a_process_killed_at_each_step_leaves_no_torn_block(tmp_path: Path, step: str) -> None:
    spec = TierSpec("hdd", tmp_path / "hdd", 1 << 20)
    tier = Tier(spec)
    tier.write("1" * 64, payload(1, 9000))
    tier.close()
    child = subprocess.run(
        [sys.executable, "-m", "tests.kv.crash_child", str(spec.directory), step],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'kvplugin'}"),
        check=False,
    )
    assert child.returncode == -signal.SIGKILL  # killed at the step, no cleanup ran
    left = {entry.name: entry.stat().st_size for entry in os.scandir(spec.directory)}
    temps = {name: size for name, size in left.items() if name.startswith(".tmp-")}
    renamed = blockfile.STEPS.index(step) > blockfile.STEPS.index("rename")
    full = blockfile.disk_size(crash_child.SIZE)
    expected_temp = {
        "open": None,
        "write": 0,
        "half-written": full // 2 // blockfile.ALIGN * blockfile.ALIGN,
    }
    if renamed:
        assert sorted(left) == ["1" * 64, crash_child.NAME] and left[crash_child.NAME] == full
    else:
        assert set(left) - set(temps) == {"1" * 64}
        sizes = list(temps.values())
        assert sizes == ([] if step == "open" else [expected_temp.get(step, full)])
    # a new process opens the tier
    reopened = Tier(spec)
    rebuilt = reopened.rebuild(100, 10.0)
    names = {name for name, _ in reopened.index()}
    assert not [n for n in os.listdir(spec.directory) if n.startswith(blockfile.TEMP_PREFIX)]
    assert rebuilt.temps_removed == len(temps)
    assert reopened.read("1" * 64) == payload(1, 9000)
    if renamed:
        assert names == {"1" * 64, crash_child.NAME}
        assert reopened.read(crash_child.NAME) == payload(2, crash_child.SIZE)
    else:
        assert names == {"1" * 64}
    assert reopened.used == sum(size for _, size in reopened.index())
    reopened.close()


def test_a_failed_write_removes_its_temp_file(tmp_path: Path) -> None:
    def disk_full(now: str) -> None:
        if now == "fsync":
            raise OSError(errno.ENOSPC, "No space left on device")

    tier = Tier(TierSpec("hdd", tmp_path / "hdd", 1 << 20), fault=disk_full)
    with pytest.raises(OSError, match="No space"):
        tier.write("3" * 64, b"x")
    assert os.listdir(tmp_path / "hdd") == []
    assert tier.used == 0


def test_tier_directories_are_owner_only_and_checked(tmp_path: Path) -> None:
    Tier(TierSpec("hdd", tmp_path / "a" / "b", 4096)).close()
    assert stat.S_IMODE(os.stat(tmp_path / "a" / "b").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    with pytest.raises(TierError, match="mode 0700"):
        Tier(TierSpec("hdd", open_dir, 4096))
    (tmp_path / "link").symlink_to(tmp_path / "a" / "b")
    with pytest.raises(TierError, match="real directory"):
        Tier(TierSpec("hdd", tmp_path / "link", 4096))


def test_padding_is_zeros_even_after_a_larger_block(tmp_path: Path) -> None:
    fd = open_dir(tmp_path / "t")
    try:
        blockfile.write(fd, "d" * 64, b"\xff" * 20_000, direct=True)  # fills the reused buffer
        blockfile.write(fd, "e" * 64, b"small", direct=True)
        data = (tmp_path / "t" / ("e" * 64)).read_bytes()
        assert len(data) == blockfile.ALIGN
        assert data[blockfile.LENGTH_BYTES + 5 :] == bytes(blockfile.ALIGN - 13)
        assert blockfile.read(fd, "d" * 64, direct=True) == b"\xff" * 20_000
    finally:
        os.close(fd)
