"""Helpers for the KV block store's tests: configurations over temp dirs, keys and payloads."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from lucia_kv import version
from lucia_kv.config import StoreConfig, TierSpec

KEY = hashlib.sha256(b"the first cache key").digest()  # 32 bytes, as config.parse_key gives
OTHER_KEY = hashlib.sha256(b"a rotated cache key").digest()


def config(
    root: Path,
    caps: dict[str, int],
    key: bytes = KEY,
    namespace: str = "ns-a",
    writers: int = 1,
    queue_blocks: int = 1024,
) -> StoreConfig:
    """A store over one directory per tier under root/<tier>/<namespace>."""
    tiers = tuple(TierSpec(name, root / name / namespace, cap) for name, cap in caps.items())
    return StoreConfig(
        namespace=namespace,
        plugin_version=version(),
        tiers=tiers,
        key=key,
        writers=writers,
        queue_blocks=queue_blocks,
    )


def block_key(n: int) -> bytes:
    return hashlib.sha256(f"block {n}".encode()).digest()


def payload(n: int, size: int) -> bytes:
    """Bytes that differ per block, so a block served for another is caught."""
    seed = hashlib.sha256(f"payload {n}".encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def flip_one_byte(path: Path) -> None:
    """Flip a byte inside the sealed payload (`length | payload | padding`: the padding is
    outside what AES-GCM authenticates), in place."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    assert 0 < length <= len(data) - 8, (path, length, len(data))
    data[8 + length // 2] ^= 0xFF
    with path.open("r+b") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
