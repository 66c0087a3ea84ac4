"""Sealing: a record opens only for its block, namespace, plugin version and key."""

from __future__ import annotations

import pytest
from lucia_kv.sealing import HEADER_BYTES, Corrupt, Sealer, StaleKey

from tests.kv.support import KEY, OTHER_KEY, block_key

BLOCK = block_key(1)


def test_round_trip_and_fresh_nonce() -> None:
    sealer = Sealer(KEY, "ns-a", "0.1.0")
    first, second = sealer.seal(BLOCK, b"kv bytes"), sealer.seal(BLOCK, b"kv bytes")
    assert first != second  # a fresh nonce per record
    assert sealer.open(BLOCK, first) == sealer.open(BLOCK, second) == b"kv bytes"
    assert b"kv bytes" not in first


@pytest.mark.parametrize(
    "opener",
    [
        Sealer(KEY, "ns-b", "0.1.0"),  # another namespace
        Sealer(KEY, "ns-a", "0.2.0"),  # another plugin version
    ],
)
def test_record_bound_to_namespace_and_version(opener: Sealer) -> None:
    record = Sealer(KEY, "ns-a", "0.1.0").seal(BLOCK, b"kv bytes")
    with pytest.raises(Corrupt):
        opener.open(BLOCK, record)


def test_record_bound_to_its_block() -> None:
    sealer = Sealer(KEY, "ns-a", "0.1.0")
    with pytest.raises(Corrupt):
        sealer.open(block_key(2), sealer.seal(BLOCK, b"kv bytes"))


@pytest.mark.parametrize("position", [0, 5, HEADER_BYTES - 1, HEADER_BYTES, -1])
def test_any_flipped_byte_fails(position: int) -> None:
    sealer = Sealer(KEY, "ns-a", "0.1.0")
    record = bytearray(sealer.seal(BLOCK, b"kv bytes" * 10))
    record[position] ^= 0x01
    with pytest.raises((Corrupt, StaleKey)):
        sealer.open(BLOCK, bytes(record))


def test_rotated_key_is_stale_not_corrupt() -> None:
    record = Sealer(KEY, "ns-a", "0.1.0").seal(BLOCK, b"kv bytes")
    with pytest.raises(StaleKey):
        Sealer(OTHER_KEY, "ns-a", "0.1.0").open(BLOCK, record)


def test_truncated_record_fails() -> None:
    sealer = Sealer(KEY, "ns-a", "0.1.0")
    record = sealer.seal(BLOCK, b"kv bytes" * 10)
    for size in (0, 3, HEADER_BYTES, len(record) - 1):
        with pytest.raises(Corrupt):
            sealer.open(BLOCK, record[:size])


def test_key_never_in_repr() -> None:
    shown = repr(Sealer(KEY, "ns-a", "0.1.0"))
    assert KEY.hex() not in shown and repr(KEY) not in shown
