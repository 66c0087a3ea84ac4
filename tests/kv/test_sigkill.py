"""A writer killed with SIGKILL at random points leaves no torn block and no more bytes than
a tier's cap: the files it left, temp files included, fit the cap; the restart indexes exactly
the block files there (evicting none) and removes the temp files; every indexed copy in every
tier opens to its own bytes."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from lucia_kv import tier as tier_module
from lucia_kv.owner import LOCK_NAME
from lucia_kv.sealing import Sealer
from lucia_kv.store import Store, block_name

from tests.kv.support import KEY, block_key, config, payload
from tests.kv.writer_child import CAPS, size_of

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 8
PER_ROUND = 100_000  # block numbers of round r start at r * PER_ROUND


def test_sigkill_of_a_writer_leaves_no_torn_block(tmp_path: Path) -> None:
    environment = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'kvplugin'}")
    chance = random.Random(22)
    names: dict[str, int] = {}
    checked = 0
    for round_ in range(ROUNDS):
        first = round_ * PER_ROUND
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.kv.writer_child", str(tmp_path), str(first)],
            cwd=ROOT,
            env=environment,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "ready"
            time.sleep(chance.uniform(0.0, 0.3))  # where the kill lands, not a timing check
            child.send_signal(signal.SIGKILL)
        finally:
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
        left = {name: files(tmp_path / name / "ns-a") for name in CAPS}
        for name, cap in CAPS.items():
            assert sum(left[name].values()) <= cap, f"{name}: more on disk than the cap"
        store = Store(config(tmp_path, CAPS))
        try:
            sealer = Sealer(KEY, store.config.namespace, store.config.plugin_version)
            for tier in store.tiers:
                blocks = {n for n in left[tier.name] if tier_module.NAME.fullmatch(n)}
                assert {name for name, _ in tier.index()} == blocks
                assert store.metrics.get("evictions", tier.name) == 0
                leftovers = [n for n in os.listdir(tier.directory) if n.startswith(".tmp-")]
                assert not leftovers, leftovers
                for name, _ in tier.index():
                    if name not in names:
                        names.update(
                            (block_name(block_key(n)), n) for n in range(first, first + 20_000)
                        )
                    n = names[name]
                    assert sealer.open(block_key(n), tier.read(name)) == payload(n, size_of(n))
                    checked += 1
        finally:
            store.close()
    assert checked > ROUNDS  # copies were there to check, every round


def files(directory: Path) -> dict[str, int]:
    """Every file in the directory and its size, but the owner lock (no block, not capped)."""
    with os.scandir(directory) as entries:
        return {
            entry.name: entry.stat(follow_symlinks=False).st_size
            for entry in entries
            if entry.name != LOCK_NAME
        }
