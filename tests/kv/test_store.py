"""The store's write-through, promotion, pins, counters and their exposition."""

from __future__ import annotations

import errno
import os
import stat
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lucia_kv import blockfile
from lucia_kv.sealing import Corrupt
from lucia_kv.store import Store, block_name, probe

from tests.kv.support import block_key, config, payload

PAGE = blockfile.ALIGN


def test_write_through_to_every_tier_and_probe(tmp_path: Path) -> None:
    store = Store(config(tmp_path, {"shm": 8 * PAGE, "nvme": 8 * PAGE, "hdd": 16 * PAGE}))
    try:
        keys = [block_key(n) for n in range(3)]
        for n, key in enumerate(keys):
            store.save(key, payload(n, 100))
        store.flush()
        for tier in store.tiers:
            assert sorted(name for name, _ in tier.index()) == sorted(map(block_name, keys))
            for name in os.listdir(tier.directory):
                assert stat.S_IMODE(os.stat(tier.directory / name).st_mode) == 0o600
        assert store.lookup([*keys, block_key(9)]) == 3
        assert probe(store.config, [keys[0], block_key(9), keys[1]]) == 1
        assert store.metrics.get("writes") == 9
    finally:
        store.close()


def test_a_read_from_the_pool_warms_the_faster_tiers(tmp_path: Path) -> None:
    caps = {"nvme": 2 * PAGE, "hdd": 16 * PAGE}
    store = Store(config(tmp_path, caps))
    try:
        for n in range(4):  # nvme keeps the last two only
            store.save(block_key(n), payload(n, 100))
        store.flush()
        nvme = store.tiers[0]
        assert not nvme.contains(block_name(block_key(0)))
        assert store.load(block_key(0)) == payload(0, 100)
        store.flush()
        assert nvme.contains(block_name(block_key(0)))
        assert store.metrics.get("hits", "hdd") == 1
        assert store.metrics.get("misses", "nvme") == 1
        assert store.metrics.get("promotions", "nvme") == 1
        assert store.metrics.get("evictions", "nvme") == 3
        assert store.load(block_key(0)) == payload(0, 100)
        assert store.metrics.get("hits", "nvme") == 1
    finally:
        store.close()


class ViewSealer:
    """Seals nothing; records what the store hands it to open."""

    def __init__(self) -> None:
        self.opened: list[type] = []

    def seal(self, block: bytes, plaintext: bytes | memoryview) -> bytes:
        return block + bytes(plaintext)

    def open(self, block: bytes, record: bytes | memoryview) -> bytes:
        self.opened.append(type(record))
        if bytes(record[: len(block)]) != block:
            raise Corrupt("another block's record")
        return bytes(record[len(block) :])


def test_a_record_opens_straight_from_the_read_buffer(tmp_path: Path) -> None:
    sealer = ViewSealer()
    store = Store(config(tmp_path, {"hdd": 16 * PAGE}), sealer=sealer)
    try:
        store.save(block_key(0), payload(0, 9000))
        store.flush()
        assert store.load(block_key(0)) == payload(0, 9000)
        assert sealer.opened == [memoryview]  # not a copy of the record first
        assert store.metrics.get("read_bytes", "hdd") == blockfile.disk_size(32 + 9000)
    finally:
        store.close()


def test_loaded_blocks_stay_whole_across_later_reads(tmp_path: Path) -> None:
    """Each read reuses one buffer: what a load returns must not be a view of it."""
    store = Store(config(tmp_path, {"hdd": 16 * PAGE}))
    try:
        for n in range(3):
            store.save(block_key(n), payload(n, 5000 + n))
        store.flush()
        loaded = [store.load(block_key(n)) for n in range(3)]
        assert loaded == [payload(n, 5000 + n) for n in range(3)]
    finally:
        store.close()


def test_a_tier_full_of_pinned_blocks_skips_writes(tmp_path: Path) -> None:
    store = Store(config(tmp_path, {"nvme": 2 * PAGE, "hdd": 16 * PAGE}))
    try:
        pinned = [block_key(0), block_key(1)]
        store.pin(pinned)
        for n in range(3):
            store.save(block_key(n), payload(n, 100))
        store.flush()
        assert store.metrics.get("skipped_writes", "nvme", "pinned") == 1
        assert store.tiers[0].contains(block_name(block_key(0)))
        store.unpin(pinned)
        store.save(block_key(5), payload(5, 100))
        store.flush()
        assert not store.tiers[0].contains(block_name(block_key(0)))  # unpinned: evictable
    finally:
        store.close()


def test_a_failed_directory_fsync_counts_the_block_as_written(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def dirsync_fails(step: str) -> None:
        if step == "dirsync":
            raise OSError(errno.EIO, "Input/output error")

    store = Store(config(tmp_path, {"nvme": 8 * PAGE, "hdd": 16 * PAGE}), fault=dirsync_fails)
    try:
        store.save(block_key(1), payload(1, 100))
        store.flush()
        assert store.metrics.get("writes") == 2
        assert store.metrics.get("skipped_writes") == 0
        assert "directory's fsync failed: Input/output error" in caplog.text
        assert store.lookup([block_key(1)]) == 1
        assert store.load(block_key(1)) == payload(1, 100)
    finally:
        store.close()


def test_metrics_text_and_file(tmp_path: Path) -> None:
    settings = replace(config(tmp_path, {"hdd": 16 * PAGE}), metrics_file=tmp_path / "kv.prom")
    store = Store(settings)
    for n in (1, 2):
        store.save(block_key(n), payload(n, 100))
        store.flush()
    # the writers went idle: the file is current without a shutdown (vLLM may never call it)
    assert 'lucia_kv_writes_total{tier="hdd"} 2' in (tmp_path / "kv.prom").read_text()
    assert store.load(block_key(3)) is None
    assert store.load(block_key(1)) == payload(1, 100)
    store.flush()
    # reads alone bring the file up to date too, written by a writer thread
    text = (tmp_path / "kv.prom").read_text()
    assert 'lucia_kv_hits_total{tier="hdd"} 1' in text
    assert 'lucia_kv_misses_total{tier="hdd"} 1' in text
    store.close()
    text = (tmp_path / "kv.prom").read_text()
    assert 'lucia_kv_writes_total{tier="hdd"} 2' in text
    assert 'lucia_kv_misses_total{tier="hdd"} 1' in text
    assert "# TYPE lucia_kv_corrupt_total counter" in text
    assert stat.S_IMODE(os.stat(tmp_path / "kv.prom").st_mode) == 0o600
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


def test_the_metrics_file_ends_current_when_two_writers_overlap(tmp_path: Path) -> None:
    """One writer's metrics-file write is slow (held here until the reads are done) while the
    other writer takes the reads' later rewrites: the file must end with every hit, not with
    the slow write's early counts."""
    settings = replace(
        config(tmp_path, {"hdd": 64 * PAGE}, writers=2), metrics_file=tmp_path / "kv.prom"
    )
    store = Store(settings)
    try:
        for n in range(15):
            store.save(block_key(n), payload(n, 100))
        store.flush()
        reads_done = threading.Event()
        first = threading.Event()
        write = store.metrics.write

        def slow_first_write(path: Path) -> None:
            if first.is_set():
                write(path)
                return
            first.set()
            text = store.metrics.render()  # this write's counts are taken now
            reads_done.wait(30)
            path.write_text(text)

        store.metrics.write = slow_first_write  # type: ignore[method-assign]
        for n in range(15):
            assert store.load(block_key(n)) == payload(n, 100)
        reads_done.set()
        store.flush()
        assert 'lucia_kv_hits_total{tier="hdd"} 15' in (tmp_path / "kv.prom").read_text()
    finally:
        store.close()


class _Together(Store):
    """A store whose two writers mark their jobs done at the same moment: each has done all
    else with its job (its counts, its look at whether to rewrite the file) before either does."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        together = threading.Barrier(2)
        (slot,) = self.slots
        done = slot.queue.task_done

        def task_done() -> None:
            together.wait(timeout=60)
            done()

        slot.queue.task_done = task_done  # type: ignore[method-assign]


def test_the_metrics_file_has_the_last_counts_when_two_writers_finish_together(
    tmp_path: Path,
) -> None:
    """Each writer saw the other's job unfinished and left the file to it: the file missed
    the last writes until some later job. The last job to finish writes it now."""
    settings = replace(
        config(tmp_path, {"hdd": 512 * PAGE}, writers=2), metrics_file=tmp_path / "kv.prom"
    )
    store = _Together(settings)
    try:
        for round_ in range(5):
            store.save(block_key(2 * round_), payload(2 * round_, 100))
            store.save(block_key(2 * round_ + 1), payload(2 * round_ + 1, 100))
            store.flush()
            expected = f'lucia_kv_writes_total{{tier="hdd"}} {2 * round_ + 2}\n'
            assert expected in (tmp_path / "kv.prom").read_text(), f"round {round_}"
    finally:
        store.close()
