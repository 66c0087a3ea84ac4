"""The key check: who a presented key is, in O(1) and without comparing secrets byte by byte.

Three kinds of key are known: the owner key and the inference key, each read once from its
secret file, and the issued `lucia_inf_` keys, known only by their SHA-256 digests in keys.json.
A presented key is hashed once; its digest is compared with the two fixed digests by
`hmac.compare_digest` (both comparisons always run) and looked up in a dict of the unrevoked
issued keys. A dict lookup by a SHA-256 digest tells a timing observer nothing about a stored
key, since nobody can choose an input for a wanted digest.

`KeyRing` is one frozen set of keys. `Verifier` holds the current ring and swaps it for a new
one when keys.json changes: at most once every RECHECK_S seconds, a request stats the file
(device, inode, size and modification time; the atomic rename makes a new inode) and reloads
it if that changed. So a revoke takes effect within RECHECK_S seconds, without a restart.

A key works as soon as `keys create` has printed it: a key the current ring does not know
makes the verifier look at the file's stamp again before refusing, at most once every
UNKNOWN_RECHECK_S seconds, so that a flood of bad keys costs one stat per interval and no more.
The two fixed keys are read once; changing them takes a restart.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Final, Literal, Protocol

from supervisor import redaction
from supervisor.host import keys
from supervisor.host.keys import IssuedKey, KeyConfigError, KeysFileInvalid
from supervisor.protocol.files import FileRefused, read_text

MIN_SECRET: Final = 32
MAX_SECRET: Final = 1024  # also the longest presented key that is hashed at all
RECHECK_S: Final = 1.0
UNKNOWN_RECHECK_S: Final = 0.005  # an unknown key: the file's stamp again, at most this often
_SECRET_READ_LIMIT: Final = 4096

Role = Literal["owner", "inference"]
SecretRule = Literal["readable", "length", "characters", "distinct"]

RULES: Final[Mapping[SecretRule, str]] = {
    "readable": "a key's secret file must be a readable regular file",
    "length": f"a key has at least {MIN_SECRET} and at most {MAX_SECRET} characters",
    "characters": "a key is printable ASCII without spaces (it travels in an HTTP header)",
    "distinct": "the owner key and the inference key must differ",
}


class SecretRefused(KeyConfigError):
    """An owner or inference key that breaks a rule; the gateway refuses to start (exit 78).
    str() names the file and the rule, never the secret."""

    def __init__(self, rule: SecretRule, path: Path, detail: str = "") -> None:
        self.rule: SecretRule = rule
        self.path = path
        super().__init__(f"{path}: {RULES[rule]}" + (f" ({detail})" if detail else ""))


@dataclass(frozen=True, slots=True)
class Identity:
    """Who a key is: the record and the logs name key_id, never the key."""

    key_id: str
    role: Role
    name: str
    budget: int | None = None  # the key's own daily token budget; None: the settings' default
    exempt: bool = False  # no daily budget is enforced against it (keys exempt ID on)


OWNER: Final = Identity("owner", "owner", "owner")
INFERENCE: Final = Identity("inference", "inference", "inference")


class KeyCheck(Protocol):
    """What the gateway needs: a presented key in, an identity or None out."""

    def verify(self, presented: str) -> Identity | None: ...


@dataclass(frozen=True, slots=True)
class _Issued:
    identity: Identity
    expires: float | None  # seconds since the epoch


def check_secret(text: str, path: Path) -> str:
    """Pure: the secret in a file's text (surrounding whitespace dropped), or SecretRefused."""
    secret = text.strip()
    if not MIN_SECRET <= len(secret) <= MAX_SECRET:
        raise SecretRefused("length", path, f"it has {len(secret)}")
    if not all(33 <= ord(char) <= 126 for char in secret):
        raise SecretRefused("characters", path)
    return secret


def read_secret(path: Path) -> str:
    try:
        text = read_text(path, limit=_SECRET_READ_LIMIT)
    except FileNotFoundError:
        raise SecretRefused("readable", path, "it does not exist") from None
    except FileRefused as exc:
        raise SecretRefused("readable", path, exc.reason) from None
    return check_secret(text, path)


@dataclass(frozen=True)
class KeyRing:
    """One frozen set of keys: the two fixed digests and the unrevoked issued keys by digest."""

    owner: bytes
    inference: bytes
    issued: Mapping[bytes, _Issued] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def build(
        cls,
        owner: str,
        inference: str,
        issued: Sequence[IssuedKey] = (),
        paths: tuple[Path, Path] = (Path("owner key"), Path("inference key")),
    ) -> KeyRing:
        """Pure: the ring for two checked secrets and keys.json's entries (revoked ones left
        out). paths name the secrets' files in an error."""
        if hmac.compare_digest(keys.digest(owner), keys.digest(inference)):
            raise SecretRefused("distinct", paths[1], f"it equals {paths[0]}")
        return cls(keys.digest(owner), keys.digest(inference)).with_issued(issued)

    def with_issued(self, issued: Sequence[IssuedKey]) -> KeyRing:
        """Pure: this ring's fixed keys with another set of issued keys."""
        table = {
            bytes.fromhex(key.sha256): _Issued(
                Identity(key.id, "inference", key.name, key.budget, key.exempt),
                key.expires.timestamp() if key.expires is not None else None,
            )
            for key in keys.unrevoked(issued)
        }
        return KeyRing(self.owner, self.inference, MappingProxyType(table))

    def verify(self, presented: str, now: float) -> Identity | None:
        """Pure: the identity of a presented key at now (epoch seconds), or None."""
        if len(presented) > MAX_SECRET:
            return None
        found = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        # both fixed comparisons run, whichever matches
        owner = hmac.compare_digest(found, self.owner)
        inference = hmac.compare_digest(found, self.inference)
        if owner:
            return OWNER
        if inference:
            return INFERENCE
        issued = self.issued.get(found)
        if issued is None or (issued.expires is not None and issued.expires <= now):
            return None
        return issued.identity


Stamp = tuple[int, int, int, int] | None


def _stamp(path: Path) -> Stamp:
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


class Verifier:
    """The gateway's KeyCheck: the current KeyRing, reloaded when keys.json changes.

    A keys.json that becomes unreadable or invalid while the gateway runs refuses every issued
    key (the owner and inference keys still work) until it is fixed; `problem` says why. At
    start, the same file is a KeysFileInvalid (a KeyConfigError, like a bad secret).
    """

    def __init__(
        self,
        keys_file: Path,
        ring: KeyRing,
        *,
        recheck: float = RECHECK_S,
        unknown_recheck: float = UNKNOWN_RECHECK_S,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.keys_file = keys_file
        self._ring = ring
        self._recheck = recheck
        self._unknown_recheck = unknown_recheck
        self._last_look = float("-inf")
        self._clock = clock
        self._monotonic = monotonic
        self._stamp: Stamp = None
        self._next_check = float("-inf")
        self._problem: str | None = None

    @classmethod
    def open(
        cls,
        keys_file: Path,
        owner_file: Path,
        inference_file: Path,
        *,
        recheck: float = RECHECK_S,
        unknown_recheck: float = UNKNOWN_RECHECK_S,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> Verifier:
        """Read both secret files and keys.json; SecretRefused or KeysFileInvalid (both
        KeyConfigError: exit 78) when one breaks a rule."""
        owner, inference = read_secret(owner_file), read_secret(inference_file)
        ring = KeyRing.build(owner, inference, (), (owner_file, inference_file))
        redaction.register([owner, inference])
        stamp = _stamp(keys_file)
        ring = ring.with_issued(keys.load(keys_file))
        verifier = cls(
            keys_file,
            ring,
            recheck=recheck,
            unknown_recheck=unknown_recheck,
            clock=clock,
            monotonic=monotonic,
        )
        verifier._stamp = stamp
        verifier._last_look = monotonic()
        verifier._next_check = verifier._last_look + recheck
        return verifier

    @property
    def ring(self) -> KeyRing:
        return self._ring

    @property
    def problem(self) -> str | None:
        """Why issued keys are refused now (keys.json unreadable), or None."""
        return self._problem

    def verify(self, presented: str) -> Identity | None:
        now = self._monotonic()
        if now >= self._next_check:
            self.refresh()
        found = self._ring.verify(presented, self._clock())
        if found is not None or now - self._last_look < self._unknown_recheck:
            return found
        # unknown: perhaps issued since the last look (`keys create` has just printed it)
        if not self.refresh():
            return None
        return self._ring.verify(presented, self._clock())

    def refresh(self) -> bool:
        """Reload keys.json if it changed since the last look; True when it was reloaded."""
        self._last_look = self._monotonic()
        self._next_check = self._last_look + self._recheck
        stamp = _stamp(self.keys_file)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            issued = keys.load(self.keys_file)
        except KeysFileInvalid as exc:
            issued, self._problem = (), str(exc)
        else:
            self._problem = None
        self._ring = self._ring.with_issued(issued)
        return True
