"""A process that owns tier directories with a real store until its stdin closes (for the
owner-lock tests: a lock is held by another process, not another thread).

`python -m tests.kv.owner_child NAMESPACE DIR...`: a store with one tier per directory; prints
"owned" once it holds them all, "taken <message>" when another store does, and "released"
after closing the store at the end of its input. child_store() runs it from a test."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lucia_kv import version
from lucia_kv.config import StoreConfig, TierSpec
from lucia_kv.owner import Taken
from lucia_kv.store import Store

from tests.kv.support import KEY

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def child_store(namespace: str, *directories: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding a store over the directories, until its input closes."""
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.kv.owner_child", namespace, *map(str, directories)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'kvplugin'}"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "owned"
        yield child
    finally:
        child.stdin.close()
        child.wait()
        child.stdout.close()


def main() -> None:
    namespace, directories = sys.argv[1], [Path(arg) for arg in sys.argv[2:]]
    names = ("shm", "nvme", "hdd")
    tiers = tuple(TierSpec(names[n], path, 1 << 20) for n, path in enumerate(directories))
    try:
        store = Store(StoreConfig(namespace, version(), tiers, KEY, writers=1))
    except Taken as exc:
        print(f"taken {exc}", flush=True)
        return
    print("owned", flush=True)
    sys.stdin.read()
    store.close()
    print("released", flush=True)


if __name__ == "__main__":
    main()
