"""Who is calling: the gateway asks an Authenticator, which the keys module provides."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, Protocol

Role = Literal["owner", "inference"]
BEARER = "bearer "


@dataclass(frozen=True)
class Identity:
    """A verified caller: a name for the record (never the key) and its role."""

    name: str
    role: Role


class Authenticator(Protocol):
    def verify(self, presented: str) -> Identity | None:
        """The identity of a presented key, or None when it is no valid key."""
        ...


def presented_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, or None."""
    if authorization is None or authorization[: len(BEARER)].lower() != BEARER:
        return None
    key = authorization[len(BEARER) :].strip()
    return key or None


class FixedKeys:
    """Keys given in full, each with its identity. A call costs one SHA-256 and one dictionary
    look-up of the digest: the key itself is never compared, so no timing tells its prefix."""

    def __init__(self, keys: dict[str, Identity]) -> None:
        self._by_digest = {hashlib.sha256(key.encode()).digest(): who for key, who in keys.items()}

    def verify(self, presented: str) -> Identity | None:
        digest = hashlib.sha256(presented.encode(errors="surrogateescape")).digest()
        return self._by_digest.get(digest)
