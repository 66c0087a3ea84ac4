"""Sealing a block: AES-256-GCM under a key derived from the cache key, bound to its place.

A sealed record is `MAGIC | key id (8) | nonce (12) | ciphertext + tag`. The associated data
binds the header, the namespace, the plugin version and the block's hash, so a record copied to
another block, namespace or plugin version fails to authenticate. The key id (a digest of the
derived key, not the key) tells a record sealed under a rotated-out key from a damaged one.
"""

from __future__ import annotations

import hashlib
import os
from typing import Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC: Final = b"LKV1"
KEY_ID_BYTES: Final = 8
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
HEADER_BYTES: Final = len(MAGIC) + KEY_ID_BYTES + NONCE_BYTES
_SALT: Final = b"lucia-kv-tiers block key salt v1"
_INFO: Final = b"lucia-kv-tiers aes-256-gcm block key v1"


class SealError(Exception):
    """A record that does not open; the block is a miss."""


class Corrupt(SealError):
    """Damaged, truncated, or sealed for another block, namespace or plugin version."""


class StaleKey(SealError):
    """Sealed under another cache key (the key was rotated): a miss, never reused."""


class BlockSealer(Protocol):
    """What the store needs of a sealer: seal and open one block's record."""

    def seal(self, block: bytes, plaintext: bytes | memoryview) -> bytes: ...

    def open(self, block: bytes, record: bytes | memoryview) -> bytes: ...


def derive(key: bytes) -> bytes:
    """The 256-bit block key from the cache key (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=_INFO).derive(key)


class Sealer:
    """Seals and opens the blocks of one namespace under one cache key."""

    __slots__ = ("_aead", "_bind", "key_id")

    def __init__(self, key: bytes, namespace: str, plugin_version: str) -> None:
        block_key = derive(key)
        self._aead = AESGCM(block_key)
        self.key_id = hashlib.sha256(b"lucia-kv key id\0" + block_key).digest()[:KEY_ID_BYTES]
        self._bind = b"\0".join((namespace.encode(), plugin_version.encode())) + b"\0"

    def __repr__(self) -> str:
        return f"Sealer(key_id={self.key_id.hex()})"

    def _aad(self, header: bytes, block: bytes) -> bytes:
        return header + self._bind + block

    def seal(self, block: bytes, plaintext: bytes | memoryview) -> bytes:
        """The sealed record of one block's bytes, under a fresh random nonce."""
        header = MAGIC + self.key_id + os.urandom(NONCE_BYTES)
        nonce = header[-NONCE_BYTES:]
        return header + self._aead.encrypt(nonce, plaintext, self._aad(header, block))

    def open(self, block: bytes, record: bytes | memoryview) -> bytes:
        """The block's bytes; raises Corrupt or StaleKey when the record does not open."""
        record = memoryview(record)
        if len(record) < HEADER_BYTES + TAG_BYTES or bytes(record[: len(MAGIC)]) != MAGIC:
            raise Corrupt("short record or bad magic")
        header = bytes(record[:HEADER_BYTES])
        if header[len(MAGIC) : len(MAGIC) + KEY_ID_BYTES] != self.key_id:
            raise StaleKey("sealed under another cache key")
        try:
            return self._aead.decrypt(
                header[-NONCE_BYTES:], record[HEADER_BYTES:], self._aad(header, block)
            )
        except InvalidTag:
            raise Corrupt("does not authenticate") from None
