"""A tier against a model (hypothesis stateful): the cap holds, pinned blocks stay, the LRU
order is the model's, and the index a restart rebuilds is the one before it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter, OrderedDict
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from lucia_kv import blockfile
from lucia_kv.config import TierSpec
from lucia_kv.tier import Tier, Written

from tests.kv.support import payload

CAP = 10 * blockfile.ALIGN
SIZES = (100, 5000, 9000, 30_000, 50_000)  # 1, 2, 3, 8 and 13 pages: the last is too big
KEYS = st.integers(min_value=0, max_value=9)


def name_of(n: int) -> str:
    return f"{n:064x}"


def size_of(n: int) -> int:
    return SIZES[n % len(SIZES)]


class TierModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="lucia-kv-tier-"))
        self.spec = TierSpec("nvme", self.root / "nvme", CAP)
        self.tier = Tier(self.spec)
        self.model: OrderedDict[str, int] = OrderedDict()  # oldest first
        self.pins: Counter[str] = Counter()

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def expect_write(self, name: str, size: int) -> Written:
        if name in self.model:
            self.model.move_to_end(name)
            return Written.PRESENT
        if size > CAP:
            return Written.TOO_BIG
        free = CAP - sum(self.model.values())
        victims = []
        for victim, victim_size in self.model.items():
            if free >= size:
                break
            if victim not in self.pins:
                victims.append(victim)
                free += victim_size
        if free < size:
            return Written.SKIPPED
        for victim in victims:
            del self.model[victim]
        self.model[name] = size
        return Written.WRITTEN

    @rule(n=KEYS)
    def write(self, n: int) -> None:
        name = name_of(n)
        expected = self.expect_write(name, blockfile.disk_size(size_of(n)))
        assert self.tier.write(name, payload(n, size_of(n))) is expected

    @rule(n=KEYS)
    def read(self, n: int) -> None:
        name = name_of(n)
        if name in self.model:
            assert self.tier.read(name) == payload(n, size_of(n))
            self.model.move_to_end(name)
        else:
            assert not self.tier.contains(name)
            try:
                self.tier.read(name)
            except blockfile.Missing:
                pass
            else:
                raise AssertionError(f"an evicted block {n} still reads")

    @rule(n=KEYS)
    def pin(self, n: int) -> None:
        self.tier.pin(name_of(n))
        self.pins[name_of(n)] += 1

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.pins)))
        self.tier.unpin(name)
        self.pins[name] -= 1
        if not self.pins[name]:
            del self.pins[name]

    @rule()
    def restart(self) -> None:
        before = self.tier.index()
        self.tier.close()
        self.tier = Tier(self.spec)
        rebuilt = self.tier.rebuild(1000, 60.0)
        assert self.tier.index() == before
        assert rebuilt.indexed == len(before) and not rebuilt.leftovers
        self.pins.clear()  # pins belong to requests, which a restart ends

    @invariant()
    def cap_holds(self) -> None:
        assert self.tier.used <= CAP

    @invariant()
    def index_is_the_model(self) -> None:
        assert self.tier.index() == list(self.model.items())

    @invariant()
    def files_are_the_index(self) -> None:
        assert sorted(os.listdir(self.spec.directory)) == sorted(self.model)

    @invariant()
    def pinned_blocks_stay(self) -> None:
        for name in self.pins:
            if name in self.model:
                assert self.tier.contains(name)


TierModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_tier_against_model = TierModel.TestCase


def test_rebuild_is_bounded_and_removes_what_it_leaves(tmp_path: Path) -> None:
    spec = TierSpec("hdd", tmp_path / "hdd", 1 << 20)
    tier = Tier(spec)
    for n in range(6):
        tier.write(name_of(n), payload(n, 10))
    tier.close()
    reopened = Tier(spec)
    rebuilt = reopened.rebuild(max_entries=4, max_seconds=60.0)
    assert rebuilt.indexed == 4 and len(rebuilt.leftovers) == 2
    assert reopened.used == 4 * blockfile.ALIGN


def test_a_smaller_cap_evicts_the_oldest_on_restart(tmp_path: Path) -> None:
    spec = TierSpec("hdd", tmp_path / "hdd", 8 * blockfile.ALIGN)
    tier = Tier(spec)
    for n in range(8):
        tier.write(name_of(n), payload(n, 10))
    tier.read(name_of(0))  # 0 becomes the most recently used
    tier.close()
    smaller = Tier(TierSpec("hdd", spec.directory, 3 * blockfile.ALIGN))
    rebuilt = smaller.rebuild(100, 60.0)
    assert rebuilt.evicted == 5
    assert [name for name, _ in smaller.index()] == [name_of(6), name_of(7), name_of(0)]
    assert len(os.listdir(spec.directory)) == 3
