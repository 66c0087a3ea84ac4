"""Parallel ranks: each has its own directory, share of the cap and sealing key, so a block of
one rank never opens as another's."""

from __future__ import annotations

import shutil
from pathlib import Path

from lucia_kv.config import for_rank
from lucia_kv.store import Store, block_name

from tests.kv.support import block_key, config, payload

PAGE = 4096


def test_a_block_copied_to_another_ranks_directory_is_a_stale_miss(tmp_path: Path) -> None:
    whole = config(tmp_path, {"hdd": 64 * PAGE})
    first, second = for_rank(whole, 0, 2), for_rank(whole, 1, 2)
    assert (first.rank, second.rank) == ("rank0", "rank1")
    store = Store(first)
    store.save(block_key(1), payload(1, 100))
    store.close()
    other = second.tiers[0].directory
    other.mkdir(mode=0o700, parents=True)
    name = block_name(block_key(1))
    shutil.copy(first.tiers[0].directory / name, other / name)
    store = Store(second)
    try:
        assert store.lookup([block_key(1)]) == 1  # indexed: a file of the right name is there
        assert store.load(block_key(1)) is None
        assert store.metrics.get("stale_key", "hdd") == 1
    finally:
        store.close()
    store = Store(first)
    try:
        assert store.load(block_key(1)) == payload(1, 100)  # its own rank still opens it
    finally:
        store.close()
