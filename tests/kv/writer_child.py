"""A process that writes blocks into a store until it is killed (for the SIGKILL test).

`python -m tests.kv.writer_child ROOT FIRST`: blocks FIRST, FIRST+1, ... with sizes from
size_of(); prints "ready" once the first block is written, then never stops by itself."""

from __future__ import annotations

import sys
from pathlib import Path

from lucia_kv.store import Store

from tests.kv.support import block_key, config, payload

CAPS = {"nvme": 1 << 20, "hdd": 8 << 20}


def size_of(n: int) -> int:
    return 1000 + (n * 7919) % 60_000


def main() -> None:
    root, first = Path(sys.argv[1]), int(sys.argv[2])
    store = Store(config(root, CAPS, writers=2, queue_blocks=8))
    n = first
    store.save(block_key(n), payload(n, size_of(n)))
    store.flush()
    print("ready", flush=True)
    while True:
        n += 1
        while not store.save(block_key(n), payload(n, size_of(n))):
            store.flush()  # the queue is full: wait for the writers


if __name__ == "__main__":
    main()
