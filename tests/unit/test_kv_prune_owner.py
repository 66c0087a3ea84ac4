"""Prune and the plugin's owner lock: a namespace a live store holds (another engine's) is never
removed, a free one is. The supervisor shares only the lock file's name with the plugin (it
never imports it); this test imports both to hold them to one name."""

from __future__ import annotations

import os
from pathlib import Path

from lucia_kv import owner

from supervisor.engines.vllm import namespaces as kv
from tests.kv.owner_child import child_store

GIB = 1024**3


def _namespace(root: Path, name: str) -> Path:
    directory = root / name
    directory.mkdir(mode=0o700)
    (directory / "block").write_bytes(b"\0" * 8192)
    return directory


def _age(directory: Path, age: int) -> None:
    when = 1_700_000_000 - age
    os.utime(directory, (when, when))


def test_the_supervisor_and_the_plugin_name_one_lock_file() -> None:
    assert kv.OWNER_LOCK == owner.LOCK_NAME


def test_a_namespace_a_live_store_holds_survives_prune_and_a_free_one_goes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "tier"
    root.mkdir(mode=0o700)
    current = _namespace(root, "c" * 32)
    live = _namespace(root, "a" * 32)  # the oldest: the first to go, were it free
    live_rank = _namespace(root, "b" * 32)  # held by a tensor-parallel rank below it
    closed = _namespace(root, "d" * 32)  # a store owned it and closed: the lock is free
    plain = _namespace(root, "e" * 32)  # no store ever opened it
    with child_store("x", closed):
        pass
    assert (closed / owner.LOCK_NAME).exists()
    with child_store("x", live), child_store("x", live_rank / "rank0"):
        for age, directory in enumerate((plain, closed, live_rank, live), start=1):
            _age(directory, 100 * age)
        removed = kv.prune(root, current.name, GIB, GIB, frozenset)  # every byte is wanted
        assert removed == [closed, plain]
        assert live.is_dir() and (live_rank / "rank0").is_dir() and current.is_dir()
    # once their engines are gone, they are old namespaces like any other
    assert kv.prune(root, current.name, GIB, GIB, frozenset) == [live, live_rank]
    assert os.listdir(root) == [current.name]
