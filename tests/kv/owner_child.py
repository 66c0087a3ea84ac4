"""A process that owns tier directories with a real store until its stdin closes (for the
owner-lock tests: a lock is held by another process, not another thread).

`python -m tests.kv.owner_child NAMESPACE DIR...`: a store with one tier per directory; prints
"owned" once it holds them all, "taken <message>" when another store does, and "released"
after closing the store at the end of its input."""

from __future__ import annotations

import sys
from pathlib import Path

from lucia_kv import version
from lucia_kv.config import StoreConfig, TierSpec
from lucia_kv.owner import Taken
from lucia_kv.store import Store

from tests.kv.support import KEY


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
