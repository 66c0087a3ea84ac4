"""KV block store benchmark: `.venv/bin/python bench/kv_store_bench.py [--blocks N] [--rounds N]`.

1. Write and read throughput of lucia_kv's Store (one disk tier, sealed with AES-256-GCM,
   direct I/O, atomic replacement) against a raw O_DIRECT write (+ fsync) and read of the same
   bytes into files in the same directory: the physical limit, measured in the same run.
2. The cost of sealing: the same Store with a plain (unencrypted) sealer, and AES-GCM alone
   over the same bytes in memory.

Variants run interleaved, so drift hits each alike; medians of --rounds. Prints a table; asserts
nothing about timings. Direct I/O means the page cache holds none of these bytes, so reads come
from the device every time. Besides the wall time, each variant's CPU time (the whole process,
every thread): the device's time wanders with the machine's load, the CPU time is what the code
itself costs.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "kvplugin"))

from lucia_kv import blockfile, version  # noqa: E402
from lucia_kv.config import StoreConfig, TierSpec  # noqa: E402
from lucia_kv.store import Store  # noqa: E402

from bench.standalone import filesystem, machine, table  # noqa: E402

MIB = 1024 * 1024
KEY = b"benchmark cache key, 32 bytes ok"


class PlainSealer:
    """No encryption: the baseline that shows what sealing costs."""

    def seal(self, block: bytes, plaintext: bytes | memoryview) -> bytes:
        return bytes(plaintext)

    def open(self, block: bytes, record: bytes | memoryview) -> bytes:
        return bytes(record)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """The wall and CPU (this process, all threads) seconds one call of `fn` took."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def keys_and_data(blocks: int, size: int) -> tuple[list[bytes], list[bytes]]:
    data = os.urandom(size)
    keys = [hashlib.sha256(f"bench block {n}".encode()).digest() for n in range(blocks)]
    return keys, [data[n:] + data[:n] for n in range(blocks)]  # distinct, incompressible


def raw_write(directory: Path, data: list[bytes]) -> None:
    size = blockfile.disk_size(len(data[0]))
    buffer = mmap.mmap(-1, size)
    try:
        for n, block in enumerate(data):
            buffer[: len(block)] = block
            fd = os.open(directory / f"raw-{n}", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
            try:
                view = memoryview(buffer)
                done = 0
                while done < size:
                    done += os.write(fd, view[done:])
                view.release()
                os.fsync(fd)
            finally:
                os.close(fd)
    finally:
        buffer.close()


def raw_read(directory: Path, blocks: int, size: int) -> None:
    buffer = mmap.mmap(-1, blockfile.disk_size(size))
    try:
        for n in range(blocks):
            fd = os.open(directory / f"raw-{n}", os.O_RDONLY | os.O_DIRECT)
            try:
                view = memoryview(buffer)
                got = 0
                while got < len(view):
                    count = os.readv(fd, [view[got:]])
                    if not count:
                        break
                    got += count
                view.release()
                bytes(buffer[:size])  # the copy out the store makes too
            finally:
                os.close(fd)
    finally:
        buffer.close()


def seal_all(aead: AESGCM, nonce: bytes, keys: list[bytes], data: list[bytes]) -> None:
    for key, block in zip(keys, data, strict=True):
        aead.encrypt(nonce, block, key)  # each result dropped: the cipher, not page faults


def open_all(aead: AESGCM, nonce: bytes, keys: list[bytes], sealed: list[bytes]) -> None:
    for key, record in zip(keys, sealed, strict=True):
        aead.decrypt(nonce, record, key)


def store_config(directory: Path, total: int, writers: int) -> StoreConfig:
    return StoreConfig(
        namespace="bench",
        plugin_version=version(),
        tiers=(TierSpec("hdd", directory, total * 2),),
        key=KEY,
        writers=writers,
        queue_blocks=4,
    )


def run(work: Path, blocks: int, size: int, rounds: int, writers: int) -> list[tuple[str, ...]]:
    keys, data = keys_and_data(blocks, size)
    total = blocks * size
    samples: dict[str, list[tuple[float, float]]] = {}
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    sealed = [aead.encrypt(nonce, block, key) for key, block in zip(keys, data, strict=True)]

    def add(name: str, seconds: tuple[float, float]) -> None:
        samples.setdefault(name, []).append(seconds)

    for _ in range(rounds):
        raw = work / "raw"
        raw.mkdir()
        add("raw O_DIRECT write + fsync", timed(lambda raw=raw: raw_write(raw, data)))
        add("raw O_DIRECT read", timed(lambda raw=raw: raw_read(raw, blocks, size)))
        shutil.rmtree(raw)
        for label, sealer in (("store", None), ("store, plain (no AES)", PlainSealer())):
            directory = work / "store"
            store = Store(store_config(directory, total, writers), sealer=sealer)

            def write(store: Store = store) -> None:
                for key, block in zip(keys, data, strict=True):
                    while not store.save(key, block):
                        time.sleep(0.0005)  # the queue is full: the writers are busy
                store.flush()

            def read(store: Store = store) -> None:
                for key in keys:
                    if store.load(key) is None:
                        raise RuntimeError("a block the store wrote did not read back")

            add(f"{label} write (save + flush)", timed(write))
            add(f"{label} read (load)", timed(read))
            store.close()
            shutil.rmtree(directory)
        add("AES-256-GCM seal, memory only", timed(lambda: seal_all(aead, nonce, keys, data)))
        add("AES-256-GCM open, memory only", timed(lambda: open_all(aead, nonce, keys, sealed)))
    medians = {
        name: statistics.median(wall for wall, _ in values) for name, values in samples.items()
    }
    cpu = {name: statistics.median(used for _, used in values) for name, values in samples.items()}
    baseline = {"write": "raw O_DIRECT write + fsync", "read": "raw O_DIRECT read"}
    rows = []
    for name, seconds in medians.items():
        kind = "write" if ("write" in name or "seal" in name) else "read"
        rows.append(
            (
                name,
                f"{seconds * 1000:.1f} ms",
                f"{total / seconds / MIB:.0f} MiB/s",
                f"{seconds / medians[baseline[kind]]:.2f}x",
                f"{cpu[name] * 1000:.1f} ms",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--block-mib", type=float, default=2.0, help="bytes per block, MiB")
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: TMPDIR)")
    args = parser.parse_args(argv)
    size = int(args.block_mib * MIB)
    print(f"{machine()}, load {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="lucia-kv-bench-", dir=args.dir) as tmp:
        work = Path(tmp)
        fs = filesystem(work)
        print(
            f"{args.blocks} blocks of {size / MIB:.2f} MiB ({args.blocks * size / MIB:.0f} MiB), "
            f"{args.rounds} rounds, median, {args.writers} writers, on {fs} ({work})"
        )
        rows = run(work, args.blocks, size, args.rounds, args.writers)
    table(rows, ("variant", "median", "throughput", "vs raw O_DIRECT", "CPU (median)"))
    print(f"load at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
