"""A tier's cap and its files: an evicted block's bytes count until its file is gone, a block is
not written while its old file is removed, a failed directory fsync leaves a counted file, and
ranks creating the same directories at once all open them."""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from lucia_kv import blockfile
from lucia_kv.config import TierSpec
from lucia_kv.tier import UNLINK, Tier, TierError, Written

from tests.kv.support import payload

PAGE = blockfile.ALIGN


def name_of(n: int) -> str:
    return f"{n:064x}"


def pages(count: int) -> int:
    """A payload size that takes this many pages on disk."""
    return count * PAGE - blockfile.LENGTH_BYTES


def disk_bytes(directory: Path) -> int:
    """The bytes of every file in the directory, temp files included."""
    with os.scandir(directory) as entries:
        return sum(entry.stat(follow_symlinks=False).st_size for entry in entries)


def assert_index_is_on_disk(tier: Tier) -> None:
    for name, size in tier.index():
        assert os.stat(tier.directory / name).st_size == size, f"indexed {name} has no file"


class Held:
    """A fault that holds the first time a write or removal reaches the step, until
    released."""

    def __init__(self, step: str = UNLINK) -> None:
        self.step = step
        self.holding = threading.Event()
        self.release = threading.Event()
        self.held = False

    def __call__(self, step: str) -> None:
        if step == self.step and not self.held:
            self.held = True
            self.holding.set()
            self.release.wait()


def in_thread(
    call: Callable[[], Written], ready: threading.Event
) -> tuple[threading.Thread, list[Written | BaseException]]:
    """Run a write in a thread; `ready` is set when it holds or ends."""
    results: list[Written | BaseException] = []

    def run() -> None:
        try:
            results.append(call())
        except BaseException as exc:
            results.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, results


def test_an_evicted_block_counts_until_its_file_is_gone(tmp_path: Path) -> None:
    hold = Held()
    tier = Tier(TierSpec("shm", tmp_path / "shm", 4 * PAGE), fault=hold)
    assert tier.write(name_of(1), payload(1, pages(4))) is Written.WRITTEN  # fills the tier
    # a small block evicts the large one; its removal is held
    thread, results = in_thread(lambda: tier.write(name_of(2), payload(2, 100)), hold.holding)
    hold.holding.wait()
    assert hold.held
    try:
        outcome = tier.write(name_of(3), payload(3, pages(3)))
        assert disk_bytes(tier.directory) <= tier.max_bytes
        assert outcome is Written.SKIPPED  # the large block's bytes are still on disk
    finally:
        hold.release.set()
        thread.join()
    assert results == [Written.WRITTEN]
    assert disk_bytes(tier.directory) == tier.used == PAGE
    assert_index_is_on_disk(tier)
    assert tier.write(name_of(3), payload(3, pages(3))) is Written.WRITTEN  # room now
    tier.close()


def test_a_discarded_block_counts_until_its_file_is_gone(tmp_path: Path) -> None:
    hold = Held()
    tier = Tier(TierSpec("shm", tmp_path / "shm", 4 * PAGE), fault=hold)
    assert tier.write(name_of(1), payload(1, pages(4))) is Written.WRITTEN
    thread = threading.Thread(target=tier.discard, args=(name_of(1),))
    thread.start()
    hold.holding.wait()
    try:
        tier.write(name_of(2), payload(2, pages(2)))
        assert disk_bytes(tier.directory) <= tier.max_bytes
    finally:
        hold.release.set()
        thread.join()
    assert disk_bytes(tier.directory) == tier.used == 0
    tier.close()


def test_a_block_is_not_written_while_its_old_file_is_removed(tmp_path: Path) -> None:
    hold = Held()
    tier = Tier(TierSpec("shm", tmp_path / "shm", 4 * PAGE), fault=hold)
    for n in (1, 2):
        assert tier.write(name_of(n), payload(n, pages(2))) is Written.WRITTEN
    # block 3 evicts block 1, the least recently used; block 1's removal is held
    thread, results = in_thread(lambda: tier.write(name_of(3), payload(3, pages(2))), hold.holding)
    hold.holding.wait()
    try:
        # a fresh copy of block 1 now would be removed with the old one, while indexed
        again = tier.write(name_of(1), payload(1, pages(2)))
    finally:
        hold.release.set()
        thread.join()
    assert results == [Written.WRITTEN]
    assert_index_is_on_disk(tier)
    assert again is Written.SKIPPED
    assert disk_bytes(tier.directory) == tier.used
    tier.close()


def test_one_write_of_a_block_at_a_time(tmp_path: Path) -> None:
    hold = Held("dirsync")  # the first write of block 1 is renamed in, not yet indexed
    tier = Tier(TierSpec("shm", tmp_path / "shm", 4 * PAGE), fault=hold)
    thread, results = in_thread(lambda: tier.write(name_of(1), payload(1, pages(2))), hold.holding)
    hold.holding.wait()
    try:
        again = tier.write(name_of(1), payload(1, pages(2)))
        for n in (2, 3):  # enough to evict a second copy of block 1, had there been one
            tier.write(name_of(n), payload(n, pages(2)))
    finally:
        hold.release.set()
        thread.join()
    assert results == [Written.WRITTEN]
    assert_index_is_on_disk(tier)
    assert again is Written.PRESENT
    assert tier.read(name_of(1)) == payload(1, pages(2))
    tier.close()


def test_a_failed_directory_fsync_leaves_the_file_counted(tmp_path: Path) -> None:
    failing = True

    def dirsync_fails(step: str) -> None:
        if step == "dirsync" and failing:
            raise OSError(errno.EIO, "Input/output error")

    tier = Tier(TierSpec("hdd", tmp_path / "hdd", 4 * PAGE), fault=dirsync_fails)
    with pytest.raises(OSError, match="Input/output"):
        tier.write(name_of(1), payload(1, pages(1)))
    assert disk_bytes(tier.directory) == tier.used
    assert tier.contains(name_of(1))
    assert tier.read(name_of(1)) == payload(1, pages(1))
    failing = False
    for n in range(2, 8):  # fill the tier past its cap: the file counted above is evicted
        tier.write(name_of(n), payload(n, pages(1)))
        assert disk_bytes(tier.directory) <= tier.max_bytes
    assert disk_bytes(tier.directory) == tier.used
    assert sorted(os.listdir(tier.directory)) == sorted(name for name, _ in tier.index())
    tier.close()


@pytest.mark.parametrize(
    ("made_as", "refusal"),
    [
        ("directory 0700", None),
        ("directory 0755", "mode 0755"),
        ("symlink", "not a directory"),
    ],
)
def test_a_parent_made_by_another_rank_at_the_same_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made_as: str, refusal: str | None
) -> None:
    """Another process creates a missing parent between the check and the mkdir."""
    raced = tmp_path / "shm" / "lucia"
    path = raced / "ns-a"
    real_mkdir = os.mkdir

    def another_rank_first(directory, mode=0o777, *, dir_fd=None):  # type: ignore[no-untyped-def]
        if Path(directory) == raced and not os.path.lexists(raced):
            if made_as == "symlink":
                (tmp_path / "elsewhere").mkdir(mode=0o700)
                raced.symlink_to(tmp_path / "elsewhere")
            else:
                real_mkdir(raced, 0o700)
                os.chmod(raced, 0o700 if made_as == "directory 0700" else 0o755)
        return real_mkdir(directory, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", another_rank_first)
    if refusal is None:
        Tier(TierSpec("shm", path, PAGE)).close()
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    else:
        with pytest.raises(TierError, match=refusal):
            Tier(TierSpec("shm", path, PAGE))
        assert not os.path.lexists(path)


def test_ranks_create_the_same_directories_at_once(tmp_path: Path) -> None:
    ranks, rounds = 8, 20
    errors: list[BaseException] = []
    for round_ in range(rounds):
        path = tmp_path / f"round-{round_}" / "shm" / "lucia" / "model" / "ns-a"
        start = threading.Barrier(ranks)

        def rank(path: Path = path, start: threading.Barrier = start) -> None:
            start.wait()
            try:
                Tier(TierSpec("shm", path, PAGE)).close()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank) for _ in range(ranks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        here = path
        while here != tmp_path:
            assert stat.S_IMODE(os.lstat(here).st_mode) == 0o700
            here = here.parent
