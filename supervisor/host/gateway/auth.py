"""Who is calling, and what that caller may do.

The gateway asks an Authenticator (the keys module's check plugs in here) for the caller of a
presented key; `allowed` decides by role: the inference role may call /v1 only, the owner also
the host API. `/metrics` needs no key: it holds counts and model names, never a key or a text.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal, Protocol

from supervisor.host.gateway.metrics import METRICS_PATH
from supervisor.protocol.files import FileRefused, read_text

Role = Literal["owner", "inference"]
BEARER: Final = "bearer "
V1: Final = "/v1/"
HOST_API: Final = "/api/host/"
MIN_KEY: Final = 32
_KEY_FILE_LIMIT: Final = 4096


class Caller(Protocol):
    """A verified caller: what the gateway reads of an identity."""

    @property
    def role(self) -> Role: ...

    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class Identity:
    """A verified caller: a name for the record (never the key) and its role."""

    name: str
    role: Role


class Authenticator(Protocol):
    def verify(self, presented: str) -> Caller | None:
        """The caller of a presented key, or None when it is no valid key."""
        ...


Access = Literal["open", "allowed", "forbidden"]


def allowed(path: str, role: Role | None) -> Access:
    """Pure: whether a caller of this role (None: no valid key yet) may call this path."""
    if path == METRICS_PATH:
        return "open"
    if role == "owner":
        return "allowed"
    return "allowed" if role == "inference" and path.startswith(V1) else "forbidden"


def presented_key(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` header, or None."""
    if authorization is None or authorization[: len(BEARER)].lower() != BEARER:
        return None
    key = authorization[len(BEARER) :].strip()
    return key or None


class KeysRefused(ValueError):
    """A key file the gateway cannot start with; str() names the file and the rule."""


def read_key(path: Path) -> str:
    try:
        text = read_text(path, limit=_KEY_FILE_LIMIT)
    except (OSError, FileRefused) as exc:
        raise KeysRefused(f"{path}: a key file must be a readable regular file ({exc})") from None
    key = text.strip()
    if len(key) < MIN_KEY or any(c.isspace() for c in key):
        raise KeysRefused(f"{path}: a key has at least {MIN_KEY} characters and no spaces")
    return key


def fixed_keys(owner_file: Path, inference_file: Path) -> FixedKeys:
    """The owner and inference keys from their files, or KeysRefused naming the rule."""
    owner, inference = read_key(owner_file), read_key(inference_file)
    if owner == inference:
        raise KeysRefused(
            f"{owner_file}, {inference_file}: the owner key and the inference key must differ"
        )
    return FixedKeys(
        {owner: Identity("owner", "owner"), inference: Identity("inference", "inference")}
    )


class FixedKeys:
    """Keys given in full, each with its identity. A call costs one SHA-256 and one dictionary
    look-up of the digest: the key itself is never compared, so no timing tells its prefix."""

    def __init__(self, keys: dict[str, Identity]) -> None:
        self._by_digest = {hashlib.sha256(key.encode()).digest(): who for key, who in keys.items()}

    def verify(self, presented: str) -> Identity | None:
        digest = hashlib.sha256(presented.encode(errors="surrogateescape")).digest()
        return self._by_digest.get(digest)
