"""A tier's disk misbehaves and the store serves on: a fault switches the tier off, a miss, and
it is tried again; a disk that something else filled is fitted to; no block is lost for lack
of time. The disks are real (ext4 on a loop device, remounted read-only or filled) where the
fault is the disk's; the fault hook injects the rest."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lucia_kv import blockfile
from lucia_kv.store import Store, block_name
from lucia_kv.tier import UNLINK

from tests.kv.support import block_key, config, flip_one_byte, payload
from tests.loop_disk import ext4, fs_error, remount

PAGE = blockfile.ALIGN
SIZE = 100  # a block's bytes in these tests
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a loop device needs root")


def until(what: str, check: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB ext4 of the test's own, mounted under tmp_path as a disk that meets an error is
    (errors=remount-ro)."""
    with ext4(tmp_path / "disk", tmp_path / "disk.img", 4 * 2**20, "errors=remount-ro"):
        yield tmp_path / "disk"


def test_a_failed_removal_of_a_damaged_block_is_a_miss_and_the_tier_goes_off(
    tmp_path: Path,
) -> None:
    """The unlink of a block that did not open fails (EIO): the load was the engine's end."""
    failing = {"on": False}

    def fault(step: str) -> None:
        if step == UNLINK and failing["on"]:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    settings = replace(config(tmp_path, {"nvme": 8 * PAGE, "hdd": 16 * PAGE}), retry_seconds=0.2)
    store = Store(settings, fault=fault)
    try:
        store.save(block_key(1), payload(1, SIZE))
        store.flush()
        flip_one_byte(store.slots[0].spec.directory / block_name(block_key(1)))
        failing["on"] = True
        assert store.load(block_key(1)) == payload(1, SIZE)  # from the HDD, the NVMe off
        assert not store.slots[0].on and store.slots[1].on
        assert store.metrics.get("tier_off", "nvme", reason="eio") == 1
        assert store.lookup([block_key(1)]) == 1  # the HDD still holds it
        failing["on"] = False
        until("the NVMe tier on again", lambda: store.slots[0].on)
        assert store.metrics.get("tier_on", "nvme") == 1
    finally:
        store.close()


@ROOT_ONLY
def test_a_tier_remounted_read_only_is_off_and_the_others_serve_on(
    disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """ext4 remounted read-only after an error: a good hit's stamp was the engine's end. Now
    the hit is served, the tier goes off (said once), the other tier serves on, and the
    retries fail quietly while the disk stays read-only."""
    caplog.set_level("WARNING", logger="lucia_kv")
    caps = {"nvme": 64 * PAGE, "hdd": 64 * PAGE}
    settings = replace(config(tmp_path, caps), retry_seconds=0.1)
    nvme = replace(settings.tiers[0], directory=disk / "nvme" / "ns-a")
    store = Store(replace(settings, tiers=(nvme, settings.tiers[1])))
    try:
        for n in range(4):
            store.save(block_key(n), payload(n, SIZE))
        store.flush()
        fs_error(disk)
        assert store.load(block_key(0)) == payload(0, SIZE)  # read, its stamp refused
        assert store.metrics.get("hits", "nvme") == 1
        assert store.metrics.get("tier_off", "nvme", reason="erofs") == 1
        assert store.load(block_key(1)) == payload(1, SIZE)  # from the HDD
        assert store.metrics.get("hits", "hdd") == 1
        assert store.save(block_key(9), payload(9, SIZE)) is False  # not for the NVMe
        store.flush()
        # block 1's promotion from the HDD and block 9: neither for the NVMe
        assert store.metrics.get("skipped_writes", "nvme", reason="off") == 2
        assert store.metrics.get("writes", "hdd") == 5
        time.sleep(1.0)  # several retries, each refused
        assert not store.slots[0].on
        assert store.slots[0].health.backoff > 0.1
        off = [r for r in caplog.records if "tier nvme off" in r.getMessage()]
        assert len(off) == 1, [r.getMessage() for r in off]
        assert "read-only file system" in off[0].getMessage()
    finally:
        store.close()


@ROOT_ONLY
def test_a_tier_on_a_read_only_disk_at_start_starts_off(disk: Path, tmp_path: Path) -> None:
    """The owner lock's O_RDWR|O_CREAT on a read-only disk was the engine's failed start."""
    (disk / "nvme" / "ns-a").mkdir(parents=True, mode=0o700)
    remount(disk, "ro")
    caps = {"nvme": 64 * PAGE, "hdd": 64 * PAGE}
    settings = replace(config(tmp_path, caps), retry_seconds=60)
    nvme = replace(settings.tiers[0], directory=disk / "nvme" / "ns-a")
    settings = replace(settings, tiers=(nvme, settings.tiers[1]))
    store = Store(settings)
    try:
        assert not store.slots[0].on and store.slots[1].on
        assert store.metrics.get("tier_off", "nvme", reason="erofs") == 1
        store.save(block_key(1), payload(1, SIZE))
        store.flush()
        assert store.load(block_key(1)) == payload(1, SIZE)
        assert store.metrics.get("hits", "hdd") == 1
    finally:
        store.close()


@ROOT_ONLY
def test_a_disk_filled_by_another_evicts_down_to_what_it_holds(
    disk: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another writer fills the disk: the tier's own count showed room, every write failed
    with one warning each and nothing was evicted. Now the tier fits itself to the disk."""
    settings = config(disk, {"hdd": 2 * 2**20})  # a cap the 4 MiB disk could hold
    store = Store(settings)
    try:
        for n in range(40):
            store.save(block_key(n), payload(n, SIZE))
        store.flush()
        filler = disk / "filler.bin"
        with filler.open("wb") as handle:  # someone else takes every free byte
            chunk = b"\1" * 65536
            while True:
                try:
                    handle.write(chunk)
                    handle.flush()
                except OSError:
                    break
        caplog.set_level("WARNING", logger="lucia_kv")
        for n in range(40, 90):
            store.save(block_key(n), payload(n, SIZE))
            store.flush()
        tier = store.slots[0]
        assert tier.on
        assert store.metrics.get("evictions", "hdd") > 0
        assert store.metrics.get("writes", "hdd") > 40  # the newest blocks are written
        assert store.lookup([block_key(89)]) == 1
        assert store.lookup([block_key(0)]) == 0  # the oldest made room
        warnings = [r for r in caplog.records if "the disk is full" in r.getMessage()]
        assert len(warnings) <= 1
    finally:
        store.close()


def test_a_tier_directory_removed_under_the_store_is_made_again(tmp_path: Path) -> None:
    settings = replace(config(tmp_path, {"nvme": 16 * PAGE, "hdd": 16 * PAGE}), retry_seconds=0.2)
    store = Store(settings)
    try:
        store.save(block_key(1), payload(1, SIZE))
        store.flush()
        shutil.rmtree(store.slots[0].spec.directory)
        assert store.load(block_key(1)) == payload(1, SIZE)  # the NVMe copy is gone: the HDD's
        store.save(block_key(2), payload(2, SIZE))  # the NVMe write fails: off
        store.flush()
        assert store.metrics.get("tier_off", "nvme", reason="enoent") == 1
        until("the NVMe tier on again", lambda: store.slots[0].on)
        assert store.slots[0].spec.directory.is_dir()
        store.save(block_key(3), payload(3, SIZE))
        store.flush()
        assert (store.slots[0].spec.directory / block_name(block_key(3))).is_file()
    finally:
        store.close()


def test_a_block_of_the_wrong_length_is_removed(tmp_path: Path) -> None:
    """A block that opens but is not a block's size was left in place and recomputed on every
    request."""
    store = Store(config(tmp_path, {"hdd": 16 * PAGE}))
    try:
        store.save(block_key(1), payload(1, SIZE + 8))
        store.flush()
        assert store.load(block_key(1), size=SIZE) is None
        assert store.metrics.get("corrupt", "hdd", reason="size") == 1
        assert not (store.slots[0].spec.directory / block_name(block_key(1))).exists()
        assert store.lookup([block_key(1)]) == 0
    finally:
        store.close()


def test_a_huge_block_file_is_never_read_into_memory(tmp_path: Path) -> None:
    """A damaged or sparse file's size sized the read buffer."""
    store = Store(config(tmp_path, {"hdd": 16 * PAGE}))
    try:
        store.save(block_key(1), payload(1, SIZE))
        store.flush()
        path = store.slots[0].spec.directory / block_name(block_key(1))
        with path.open("r+b") as handle:
            handle.truncate(2**40)  # sparse: a terabyte by its size
        assert store.load(block_key(1), size=SIZE) is None
        assert store.metrics.get("corrupt", "hdd", reason="size") == 1
        assert not path.exists()
    finally:
        store.close()


def test_a_slow_restart_keeps_every_block(tmp_path: Path) -> None:
    """A rebuild out of time (a deadline of 0) deleted every block it had not reached."""
    settings = config(tmp_path, {"hdd": 64 * PAGE})
    store = Store(settings)
    for n in range(50):
        store.save(block_key(n), payload(n, SIZE))
    store.close()
    slow = Store(replace(settings, rebuild_max_seconds=0.0))
    try:
        slow.flush()  # the rest of the index is built by the tier's writer
        assert slow.lookup([block_key(n) for n in range(50)]) == 50
        assert all(slow.load(block_key(n)) == payload(n, SIZE) for n in range(50))
        assert len([n for n in os.listdir(settings.tiers[0].directory) if len(n) == 64]) == 50
    finally:
        slow.close()


def test_a_slow_tier_never_holds_a_fast_one(tmp_path: Path) -> None:
    """One queue wrote every tier: the HDD's fsyncs held the NVMe's writes, and a full queue
    dropped a block from all of them. Each tier now has its own writers and bound."""
    settings = replace(
        config(tmp_path, {"nvme": 64 * PAGE, "hdd": 64 * PAGE}, writers=1), queue_blocks=4
    )
    store = Store(settings)
    gate = threading.Event()
    try:
        with store.slots[1].using() as hdd:  # the HDD's writer is held inside its first job
            assert hdd is not None
            write = hdd.write

            def slow_write(*args: Any, **kwargs: Any) -> Any:
                gate.wait(30)
                return write(*args, **kwargs)

            hdd.write = slow_write  # type: ignore[method-assign]
        for n in range(12):  # at the pace the NVMe writes: the HDD's queue fills
            store.save(block_key(n), payload(n, SIZE))
            until(f"the NVMe holds block {n}", lambda n=n: store.lookup([block_key(n)]) == 1)
        assert store.metrics.get("skipped_writes", "nvme", reason="queue_full") == 0
        assert store.metrics.get("skipped_writes", "hdd", reason="queue_full") > 0
        assert store.metrics.get("writes", "hdd") == 0
        gate.set()
        store.flush()
        assert store.metrics.get("writes", "hdd") > 0
    finally:
        gate.set()
        store.close()


def test_the_queued_blocks_are_bounded_in_bytes(tmp_path: Path) -> None:
    """The write queue was bounded in blocks only: 1024 of them, 16 GiB at a CPU block size.
    Now every queued block's bytes count against queue_bytes, once however many tiers hold it."""
    settings = replace(
        config(tmp_path, {"nvme": 64 * PAGE, "hdd": 64 * PAGE}, writers=1), queue_bytes=3 * SIZE
    )
    store = Store(settings)
    gate = threading.Event()
    try:
        for slot in store.slots:  # both tiers' writers are held inside their first job
            with slot.using() as tier:
                assert tier is not None
                write = tier.write

                def held(*args: Any, write: Any = write, **kwargs: Any) -> Any:
                    gate.wait(30)
                    return write(*args, **kwargs)

                tier.write = held  # type: ignore[method-assign]
        accepted = [store.save(block_key(n), payload(n, SIZE)) for n in range(10)]
        assert accepted == [True] * 3 + [False] * 7
        assert store.metrics.get("skipped_writes", "nvme", reason="queue_full") == 7
        assert store.metrics.get("skipped_writes", "hdd", reason="queue_full") == 7
        gate.set()
        store.flush()
        assert store.metrics.get("writes") == 6  # three blocks, each on both tiers
        assert store.save(block_key(20), payload(20, SIZE))  # the bytes were given back
        store.flush()
    finally:
        gate.set()
        store.close()
