"""Sealing a block: AES-256-GCM under a key of its own per namespace, rank and sealing epoch.

The keys (HKDF-SHA256 each; `|` is concatenation, `0` one zero byte):

    rank key  = HKDF(ikm=cache key, salt=SALT, info=INFO | namespace | 0 | rank)
    key id    = SHA-256("lucia-kv key id" | 0 | rank key)[:8]
    epoch key = HKDF(ikm=rank key, salt=epoch, info=EPOCH_INFO)

The cache key is 32 random bytes (config.py). Each namespace and parallel rank has its own rank
key, so a record never opens in another namespace or rank, and the key ids differ. A sealer
draws a random 16-byte epoch when it starts and seals under that epoch's key with a fresh random
96-bit nonce per record. NIST SP 800-38D allows at most 2^32 records under one key with random
nonces; a sealer draws a new epoch after SEALS_PER_EPOCH (2^31) records, and every process
draws its own, so no key comes near the bound (two of n epochs coincide with probability
about n^2 / 2^129).

A sealed record is `MAGIC | key id (8) | epoch (16) | nonce (12) | ciphertext + tag`. The
associated data binds the header, the namespace, the rank, the plugin version and the block's
hash, so a record copied to another block or plugin version fails to authenticate. The key id
(a digest of the rank key, not the key) tells a record sealed under a rotated-out key, or for
another namespace or rank, from a damaged one.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from typing import Final, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC: Final = b"LKV2"
KEY_BYTES: Final = 32
KEY_ID_BYTES: Final = 8
EPOCH_BYTES: Final = 16
NONCE_BYTES: Final = 12
TAG_BYTES: Final = 16
HEADER_BYTES: Final = len(MAGIC) + KEY_ID_BYTES + EPOCH_BYTES + NONCE_BYTES
SEALS_PER_EPOCH: Final = 2**31  # half the NIST bound for random 96-bit nonces under one key
EPOCHS_KEPT: Final = 256  # epoch keys kept for opening (one per process that wrote the tier)
SALT: Final = b"lucia-kv-tiers rank key salt v2"
INFO: Final = b"lucia-kv-tiers aes-256-gcm rank key v2\0"
EPOCH_INFO: Final = b"lucia-kv-tiers aes-256-gcm epoch key v2"
KEY_ID_CONTEXT: Final = b"lucia-kv key id\0"


class SealError(Exception):
    """A record that does not open; the block is a miss."""


class Corrupt(SealError):
    """Damaged, truncated, or sealed for another block or plugin version."""


class StaleKey(SealError):
    """Sealed under another rank key (the cache key was rotated, or the record is another
    namespace's or rank's): a miss, never reused."""


class BlockSealer(Protocol):
    """What the store needs of a sealer: seal and open one block's record."""

    def seal(self, block: bytes, plaintext: bytes | memoryview) -> bytes: ...

    def open(self, block: bytes, record: bytes | memoryview) -> bytes: ...


def _hkdf(ikm: bytes, salt: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=salt, info=info).derive(ikm)


def derive(key: bytes, namespace: str, rank: str = "") -> bytes:
    """The rank key of one namespace and parallel rank, from the 32-byte cache key."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"the cache key is {KEY_BYTES} bytes, got {len(key)}")
    return _hkdf(key, SALT, INFO + namespace.encode() + b"\0" + rank.encode())


def key_id(rank_key: bytes) -> bytes:
    """The id a record carries of the rank key it was sealed under (reveals nothing of it)."""
    return hashlib.sha256(KEY_ID_CONTEXT + rank_key).digest()[:KEY_ID_BYTES]


def epoch_key(rank_key: bytes, epoch: bytes) -> bytes:
    """The AES-256-GCM key of one sealing epoch."""
    return _hkdf(rank_key, epoch, EPOCH_INFO)


class Sealer:
    """Seals and opens the blocks of one namespace and rank under one cache key; thread-safe."""

    __slots__ = (
        "_bind",
        "_epoch",
        "_limit",
        "_lock",
        "_opening",
        "_rank_key",
        "_sealed",
        "_sealing",
        "key_id",
    )

    def __init__(
        self,
        key: bytes,
        namespace: str,
        plugin_version: str,
        rank: str = "",
        seals_per_epoch: int = SEALS_PER_EPOCH,
    ) -> None:
        self._rank_key = derive(key, namespace, rank)
        self.key_id = key_id(self._rank_key)
        self._bind = b"\0".join((namespace.encode(), rank.encode(), plugin_version.encode()))
        self._bind += b"\0"
        self._limit = seals_per_epoch
        self._lock = threading.Lock()
        self._opening: OrderedDict[bytes, AESGCM] = OrderedDict()
        self._epoch = b""
        self._sealing = self._new_epoch()
        self._sealed = 0

    def __repr__(self) -> str:
        return f"Sealer(key_id={self.key_id.hex()})"

    @property
    def epoch(self) -> bytes:
        """The epoch new records are sealed in."""
        with self._lock:
            return self._epoch

    def _new_epoch(self) -> AESGCM:
        self._epoch = os.urandom(EPOCH_BYTES)
        return self._remember(self._epoch)

    def _remember(self, epoch: bytes) -> AESGCM:
        """The epoch's cipher, kept (most recent last, at most EPOCHS_KEPT) for opening."""
        found = self._opening.get(epoch)
        if found is None:
            found = self._opening[epoch] = AESGCM(epoch_key(self._rank_key, epoch))
            while len(self._opening) > EPOCHS_KEPT:
                self._opening.popitem(last=False)
        self._opening.move_to_end(epoch)
        return found

    def _aad(self, header: bytes, block: bytes) -> bytes:
        return header + self._bind + block

    def seal(self, block: bytes, plaintext: bytes | memoryview) -> bytes:
        """The sealed record of one block's bytes, under a fresh random nonce."""
        with self._lock:
            if self._sealed >= self._limit:
                self._sealing = self._new_epoch()
                self._sealed = 0
            self._sealed += 1
            aead, epoch = self._sealing, self._epoch
        nonce = os.urandom(NONCE_BYTES)
        header = MAGIC + self.key_id + epoch + nonce
        return header + aead.encrypt(nonce, plaintext, self._aad(header, block))

    def open(self, block: bytes, record: bytes | memoryview) -> bytes:
        """The block's bytes; raises Corrupt or StaleKey when the record does not open."""
        record = memoryview(record)
        if len(record) < HEADER_BYTES + TAG_BYTES or bytes(record[: len(MAGIC)]) != MAGIC:
            raise Corrupt("short record or bad magic")
        header = bytes(record[:HEADER_BYTES])
        at = len(MAGIC)
        if header[at : at + KEY_ID_BYTES] != self.key_id:
            raise StaleKey("sealed under another rank key")
        at += KEY_ID_BYTES
        with self._lock:
            aead = self._remember(header[at : at + EPOCH_BYTES])
        try:
            return aead.decrypt(
                header[-NONCE_BYTES:], record[HEADER_BYTES:], self._aad(header, block)
            )
        except InvalidTag:
            raise Corrupt("does not authenticate") from None
