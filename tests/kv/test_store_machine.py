"""The store against a model (hypothesis stateful) while its files are damaged: a flipped
byte, a truncation, a deleted file, a file renamed in from another namespace and a rotated key
each give the other copy or a miss, counted, and never another block's bytes. Three writer
threads save batches at once, and after each step the directories themselves are checked: no
more bytes than the cap, no temp file, no file the index does not count, and no indexed block
without its file unless the test removed it."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from lucia_kv import blockfile
from lucia_kv.owner import LOCK_NAME
from lucia_kv.sealing import HEADER_BYTES, Sealer
from lucia_kv.store import Store, block_name

from tests.kv.support import KEY, block_key, config, payload

SHM = "/dev/shm"  # tmpfs: real files and O_DIRECT, without a disk's fsync per step
CAPS = {"shm": 3 * 2 * blockfile.ALIGN, "hdd": 64 * 2 * blockfile.ALIGN}
SIZE = 5000  # two pages on disk
KEYS = st.integers(min_value=0, max_value=4)
TIERS = st.sampled_from(sorted(CAPS))
WRITERS = 3
Damage = str  # "auth", "short", "missing" (corrupt) or "stale" (another key)


class StoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="lucia-kv-store-", dir=SHM))
        self.key = KEY
        self.rotations = 0
        self.dirsync_fails = False
        self.store = self.open()
        self.damage: dict[tuple[str, int], Damage] = {}
        self.corrupt: Counter[tuple[str, str]] = Counter()
        self.stale: Counter[str] = Counter()

    def open(self) -> Store:
        return Store(config(self.root, CAPS, key=self.key, writers=WRITERS), fault=self.fault)

    def fault(self, step: str) -> None:
        if step == "dirsync" and self.dirsync_fails:
            raise OSError(errno.EIO, "Input/output error")

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def tier(self, name: str):  # type: ignore[no-untyped-def]
        return next(t for t in self.store.tiers if t.name == name)

    def path(self, tier: str, n: int) -> Path:
        return self.tier(tier).directory / block_name(block_key(n))

    def held(self, tier: str, n: int) -> bool:
        return bool(self.tier(tier).contains(block_name(block_key(n))))

    def resync(self) -> None:
        """A damaged copy the tier no longer holds is gone from the model too."""
        for tier, n in list(self.damage):
            if not self.held(tier, n):
                del self.damage[(tier, n)]

    def intact(self) -> list[tuple[str, int]]:
        """The (tier, block) copies held and not yet damaged."""
        return [
            (tier, n)
            for tier in sorted(CAPS)
            for n in range(5)
            if self.held(tier, n) and (tier, n) not in self.damage
        ]

    @rule(n=KEYS)
    def save(self, n: int) -> None:
        assert self.store.save(block_key(n), payload(n, SIZE))
        self.store.flush()
        self.resync()

    @rule(ns=st.lists(KEYS, min_size=2, max_size=6))
    def save_at_once(self, ns: list[int]) -> None:
        """A batch the writers take concurrently (a block twice in it too)."""
        for n in ns:
            assert self.store.save(block_key(n), payload(n, SIZE))
        self.store.flush()
        self.resync()

    @rule(n=KEYS)
    def save_while_the_directory_fsync_fails(self, n: int) -> None:
        """The file is in place though its directory's fsync failed: counted and served."""
        self.dirsync_fails = True
        try:
            self.save(n)
        finally:
            self.dirsync_fails = False

    @rule(n=KEYS)
    def load(self, n: int) -> None:
        expected = None
        for tier in ("shm", "hdd"):
            if not self.held(tier, n):
                continue
            damage = self.damage.get((tier, n))
            if damage is None:
                expected = payload(n, SIZE)
                break
            if damage == "stale":
                self.stale[tier] += 1
            else:
                self.corrupt[(tier, damage)] += 1
            del self.damage[(tier, n)]  # the store removes it; a promotion may write anew
        got = self.store.load(block_key(n))
        assert got == expected  # the block's own bytes, or a miss: never another's
        self.store.flush()
        self.resync()

    @rule(tier=TIERS, n=KEYS)
    def flip_a_byte(self, tier: str, n: int) -> None:
        if (tier, n) not in self.intact():
            return  # drawn from every copy, not from those held: writers race for the cap
        path = self.path(tier, n)
        data = bytearray(path.read_bytes())
        data[blockfile.LENGTH_BYTES + HEADER_BYTES + 100] ^= 0x20  # in the ciphertext
        path.write_bytes(bytes(data))
        self.damage[(tier, n)] = "auth"

    @rule(tier=TIERS, n=KEYS)
    def truncate(self, tier: str, n: int) -> None:
        if (tier, n) not in self.intact():
            return  # drawn from every copy, not from those held: writers race for the cap
        os.truncate(self.path(tier, n), blockfile.ALIGN)
        self.damage[(tier, n)] = "short"

    @rule(tier=TIERS, n=KEYS)
    def delete(self, tier: str, n: int) -> None:
        if (tier, n) not in self.intact():
            return  # drawn from every copy, not from those held: writers race for the cap
        self.path(tier, n).unlink()
        self.damage[(tier, n)] = "missing"

    @rule(tier=TIERS, n=KEYS)
    def rename_in_from_another_namespace(self, tier: str, n: int) -> None:
        if (tier, n) not in self.intact():
            return  # drawn from every copy, not from those held: writers race for the cap
        other = self.root / "other-namespace"
        other.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(other, os.O_RDONLY | os.O_DIRECTORY)
        try:
            record = Sealer(self.key, "ns-b", self.store.config.plugin_version).seal(
                block_key(n), payload(n, SIZE)
            )
            blockfile.write(fd, block_name(block_key(n)), record, direct=True)
        finally:
            os.close(fd)
        os.rename(other / block_name(block_key(n)), self.path(tier, n))
        self.damage[(tier, n)] = "stale"  # each namespace seals under a key of its own

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = self.open()
        self.resync()  # a deleted file is no longer indexed
        self.corrupt.clear()  # a new process counts from zero
        self.stale.clear()

    @rule()
    def rotate_key(self) -> None:
        self.store.close()
        self.rotations += 1
        self.key = hashlib.sha256(f"rotated cache key {self.rotations}".encode()).digest()
        self.store = self.open()
        self.resync()
        self.corrupt.clear()
        self.stale.clear()
        for tier in CAPS:
            for n in range(5):
                if self.held(tier, n) and self.damage.get((tier, n)) != "short":
                    self.damage[(tier, n)] = "stale"  # the key id is read before the tag

    @invariant()
    def the_files_are_the_index_under_the_cap(self) -> None:
        names = {block_name(block_key(n)): n for n in range(5)}
        for tier in self.store.tiers:
            with os.scandir(tier.directory) as entries:
                files = {
                    e.name: e.stat(follow_symlinks=False).st_size
                    for e in entries
                    if e.name != LOCK_NAME  # the owner lock: no block, not capped
                }
            assert sum(files.values()) <= tier.max_bytes, files
            index = dict(tier.index())
            assert set(files) <= set(index), f"{tier.name}: files out of the index"
            for name, size in index.items():
                damage = self.damage.get((tier.name, names[name]))
                if damage is None or damage in ("auth", "stale"):
                    assert files.get(name) == size, f"{tier.name}: {name} is not on disk"

    @invariant()
    def counted(self) -> None:
        metrics = self.store.metrics
        for tier in CAPS:
            for reason in ("auth", "short", "missing"):
                assert metrics.get("corrupt", tier, reason) == self.corrupt[(tier, reason)]
            assert metrics.get("stale_key", tier) == self.stale[tier]


StoreModel.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_store_against_model = StoreModel.TestCase
