"""Sealing: a record opens only for its block, namespace, rank, plugin version and key; each
namespace and rank seals under a key of its own, derived as the module says."""

from __future__ import annotations

import hashlib
import os

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from lucia_kv.sealing import (
    EPOCH_BYTES,
    HEADER_BYTES,
    KEY_ID_BYTES,
    MAGIC,
    NONCE_BYTES,
    Corrupt,
    Sealer,
    StaleKey,
)

from tests.kv.support import KEY, OTHER_KEY, block_key

BLOCK = block_key(1)


def test_round_trip_and_fresh_nonce() -> None:
    sealer = Sealer(KEY, "ns-a", "0.1.0")
    first, second = sealer.seal(BLOCK, b"kv bytes"), sealer.seal(BLOCK, b"kv bytes")
    assert first != second  # a fresh nonce per record
    assert sealer.open(BLOCK, first) == sealer.open(BLOCK, second) == b"kv bytes"
    assert b"kv bytes" not in first


def test_record_bound_to_its_plugin_version() -> None:
    record = Sealer(KEY, "ns-a", "0.1.0").seal(BLOCK, b"kv bytes")
    with pytest.raises(Corrupt):
        Sealer(KEY, "ns-a", "0.2.0").open(BLOCK, record)


@pytest.mark.parametrize(
    ("namespace", "rank"),
    [("ns-b", ""), ("ns-a", "rank1"), ("ns-a", "dp1"), ("ns-a", "dp1/rank0")],
    ids=["another namespace", "another rank", "another data-parallel rank", "dp and rank"],
)
def test_each_namespace_and_rank_seals_under_its_own_key(namespace: str, rank: str) -> None:
    mine, other = Sealer(KEY, "ns-a", "0.1.0"), Sealer(KEY, namespace, "0.1.0", rank)
    assert mine.key_id != other.key_id
    with pytest.raises(StaleKey):
        other.open(BLOCK, mine.seal(BLOCK, b"kv bytes"))
    with pytest.raises(StaleKey):
        mine.open(BLOCK, other.seal(BLOCK, b"kv bytes"))


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


def test_the_keys_are_derived_as_the_module_says() -> None:
    """Written out from the docstring alone: a record the sealer made opens under the keys
    derived here, and one sealed here opens in the sealer."""
    rank_key = _hkdf(
        KEY,
        b"lucia-kv-tiers rank key salt v2",
        b"lucia-kv-tiers aes-256-gcm rank key v2\0" + b"ns-a\0rank1",
    )
    key_id = hashlib.sha256(b"lucia-kv key id\0" + rank_key).digest()[:8]
    sealer = Sealer(KEY, "ns-a", "0.1.0", "rank1")
    assert sealer.key_id == key_id
    bind = b"ns-a\0rank1\x000.1.0\0"
    record = sealer.seal(BLOCK, b"kv bytes")
    assert record[:4] == MAGIC and record[4:12] == key_id
    epoch, nonce = record[12:28], record[28:40]
    aead = AESGCM(_hkdf(rank_key, epoch, b"lucia-kv-tiers aes-256-gcm epoch key v2"))
    assert aead.decrypt(nonce, record[40:], record[:40] + bind + BLOCK) == b"kv bytes"
    epoch, nonce = os.urandom(16), os.urandom(12)
    header = MAGIC + key_id + epoch + nonce
    aead = AESGCM(_hkdf(rank_key, epoch, b"lucia-kv-tiers aes-256-gcm epoch key v2"))
    mine = header + aead.encrypt(nonce, b"sealed by hand", header + bind + BLOCK)
    assert sealer.open(BLOCK, mine) == b"sealed by hand"


def _epoch(record: bytes) -> bytes:
    at = len(MAGIC) + KEY_ID_BYTES
    return record[at : at + EPOCH_BYTES]


def test_a_new_epoch_key_after_the_bound_and_for_each_sealer() -> None:
    sealer = Sealer(KEY, "ns-a", "0.1.0", seals_per_epoch=3)
    records = [sealer.seal(block_key(n), b"kv %d" % n) for n in range(7)]
    epochs = [_epoch(record) for record in records]
    assert epochs[0] == epochs[1] == epochs[2] != epochs[3]
    assert epochs[3] == epochs[4] == epochs[5] != epochs[6]
    assert len(set(epochs)) == 3
    assert len({r[HEADER_BYTES - NONCE_BYTES : HEADER_BYTES] for r in records}) == 7
    again = Sealer(KEY, "ns-a", "0.1.0")  # another process: its own epoch, the old ones open
    assert _epoch(again.seal(BLOCK, b"x")) not in epochs
    for n, record in enumerate(records):
        assert again.open(block_key(n), record) == b"kv %d" % n


@pytest.mark.parametrize("size", [0, 16, 31, 33, 64])
def test_a_cache_key_is_32_bytes(size: int) -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        Sealer(b"k" * size, "ns-a", "0.1.0")


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
