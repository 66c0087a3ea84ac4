"""Issued inference keys: `lucia_inf_<random>`, of which only the SHA-256 digest is kept.

`<data>/inference-keys/keys.json` (paths.keys_file) holds one entry per key: its id, name,
digest, when it was created, when it expires (or never), when it was revoked (or not), its own
daily token budget (or the settings') and whether it is exempt from the daily budget. The key
itself is shown once, by `keys create`, and is nowhere else. The file is 0600 in a 0700
directory, replaced atomically under a lock, so a reader (the gateway) sees the old set or the
new one. At most MAX_KEYS keys are unrevoked at once; revoked entries stay, so that a record
row's key id still has a name.

The decisions (add, revoke, mark_exempt, parse an expiry) are pure; load, save, create, set_budget,
set_exempt and revoke_key are their effects.

An exempt key (`keys create --exempt`, `keys exempt ID on|off`) has no daily budget whatever its
own or the settings' say: a service such as a platform's radar, whose generations are counted
and recorded as any caller's but never refused for their number. Its own budget is kept, and
applies again once it is no longer exempt. Admission bounds it as any caller.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.protocol.documents import UtcTime
from supervisor.protocol.files import FileLock, FileRefused, ensure_dir, read_text, write_atomic

PREFIX: Final = "lucia_inf_"
MAX_KEYS: Final = 1000  # unrevoked keys at once
FILE_MODE: Final = 0o600
DIR_MODE: Final = 0o700
# 1,000 unrevoked entries take about 250 KB; revoked ones stay, so leave room for many
READ_LIMIT: Final = 16 * 1024 * 1024
_LOCK: Final = ".keys.lock"
_RANDOM_BYTES: Final = 32  # 256 bits: an unsalted digest cannot be searched
_ID_BYTES: Final = 6
ID_PATTERN: Final = re.compile(r"key_[0-9a-f]{12}")
NAME_PATTERN: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST_PATTERN: Final = r"^[0-9a-f]{64}$"
_DURATION: Final = re.compile(r"([1-9][0-9]{0,5})([hdw])")
_UNITS: Final = {"h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}

KeyState = Literal["active", "expired", "revoked"]


MAX_BUDGET: Final = 10**15  # daily tokens


class KeyConfigError(ValueError):
    """What an operator must fix before the keys can be checked (the gateway exits 78)."""


class KeysFileInvalid(KeyConfigError):
    """keys.json exists but cannot be read or parsed; str() names the file and the problem."""


class KeyRefused(ValueError):
    """A keys command that cannot be done as asked; str() says why, and what to do instead."""


class BadExpiry(ValueError):
    """An --expires value that is neither a duration nor an ISO date or time in the future."""


class IssuedKey(BaseModel):
    """One entry of keys.json: never the key, only its SHA-256 digest (hex)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    id: str = Field(pattern=ID_PATTERN.pattern + "$")
    name: str = Field(pattern="^" + NAME_PATTERN.pattern + "$")
    sha256: str = Field(pattern=_DIGEST_PATTERN)
    created: UtcTime
    expires: UtcTime | None = None
    revoked: UtcTime | None = None
    budget: int | None = Field(default=None, ge=1, le=MAX_BUDGET)  # daily tokens; None: the default
    exempt: bool = False  # True: no daily budget is enforced against it (a file from before: none)

    def state(self, now: datetime) -> KeyState:
        if self.revoked is not None:
            return "revoked"
        if self.expires is not None and self.expires <= now:
            return "expired"
        return "active"


class KeysDocument(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, populate_by_name=True)

    schema_version: Literal[1] = Field(default=1, alias="schemaVersion")
    keys: tuple[IssuedKey, ...] = ()


@dataclass(frozen=True)
class NewKey:
    """A key as `create` makes it: the secret, shown once, and the entry that is kept."""

    secret: str
    entry: IssuedKey


def digest(secret: str) -> bytes:
    """The SHA-256 digest a key is known by (unsalted: issued keys carry 256 random bits)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


def check_name(name: str) -> str:
    if NAME_PATTERN.fullmatch(name) is None or ID_PATTERN.fullmatch(name) is not None:
        raise KeyRefused(
            f"{name!r} is not a key name: 1-64 letters, digits, '.', '_' or '-', starting with "
            "a letter or digit, and not shaped like a key id (key_ and 12 hex digits)"
        )
    return name


def parse_expiry(text: str, now: datetime) -> datetime:
    """A duration (`12h`, `30d`, `8w`) from now, an ISO date (`2026-12-31`: the key expires at
    the start of that day, UTC) or an ISO date and time with its offset. It must be later than
    now."""
    value = text.strip()
    duration = _DURATION.fullmatch(value)
    if duration is not None:
        expires = now + int(duration.group(1)) * _UNITS[duration.group(2)]
    else:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise BadExpiry(
                f"{text!r} is not an expiry: give a duration (12h, 30d, 8w), an ISO date "
                "(2026-12-31) or an ISO time with its offset (2026-12-31T18:00+01:00)"
            ) from None
        if len(value) == len("2026-12-31"):
            parsed = parsed.replace(tzinfo=UTC)
        if parsed.tzinfo is None:
            raise BadExpiry(f"{text!r} has no UTC offset: add one, e.g. Z or +01:00")
        expires = parsed.astimezone(UTC)
    if expires <= now:
        raise BadExpiry(f"{text!r} is not in the future")
    return expires


def unrevoked(keys: Sequence[IssuedKey]) -> tuple[IssuedKey, ...]:
    return tuple(key for key in keys if key.revoked is None)


def add(keys: Sequence[IssuedKey], entry: IssuedKey) -> tuple[IssuedKey, ...]:
    """Pure: the keys with entry added, or KeyRefused (the limit, a name or id in use)."""
    held = unrevoked(keys)
    if len(held) >= MAX_KEYS:
        raise KeyRefused(
            f"there are already {len(held)} unrevoked keys, the most there may be; "
            "revoke one (lucia-supervisor keys revoke ID) before creating another"
        )
    clash = next((key for key in held if key.name == entry.name), None)
    if clash is not None:
        raise KeyRefused(
            f"a key named {entry.name!r} exists ({clash.id}); revoke it first, or choose "
            "another name"
        )
    if any(key.id == entry.id or key.sha256 == entry.sha256 for key in keys):
        raise KeyRefused(f"the new key's id {entry.id} is in use; create it again")
    return (*keys, entry)


def find(keys: Sequence[IssuedKey], ref: str) -> IssuedKey:
    """The key with this id, else the unrevoked key with this name; KeyRefused if none."""
    match = next((key for key in keys if key.id == ref), None)
    if match is None:
        match = next((key for key in unrevoked(keys) if key.name == ref), None)
    if match is None:
        raise KeyRefused(f"no key has the id or (unrevoked) name {ref!r}; see keys list")
    return match


def revoke(
    keys: Sequence[IssuedKey], ref: str, now: datetime
) -> tuple[tuple[IssuedKey, ...], IssuedKey]:
    """Pure: the keys with ref's key revoked at now, and that key. Revoking a revoked key
    changes nothing (its first revocation time stays)."""
    target = find(keys, ref)
    if target.revoked is not None:
        return tuple(keys), target
    done = target.model_copy(update={"revoked": now})
    return tuple(done if key.id == target.id else key for key in keys), done


def mark_exempt(
    keys: Sequence[IssuedKey], ref: str, on: bool
) -> tuple[tuple[IssuedKey, ...], IssuedKey]:
    """Pure: the keys with ref's key made exempt from the daily budget (on) or not, and that
    key. A revoked key is refused: it is never checked again, so the change would say nothing."""
    target = find(keys, ref)
    if target.revoked is not None:
        raise KeyRefused(
            f"{target.id} ({target.name}) was revoked at {_iso(target.revoked)}: it is never "
            "accepted again, exempt or not"
        )
    done = target.model_copy(update={"exempt": on})
    return tuple(done if key.id == target.id else key for key in keys), done


def describe(keys: Sequence[IssuedKey], now: datetime) -> list[dict[str, str | bool | None]]:
    """What `keys list` shows: never the digest, let alone the key."""
    return [
        {
            "id": key.id,
            "name": key.name,
            "created": _iso(key.created),
            "expires": _iso(key.expires) if key.expires else None,
            "revoked": _iso(key.revoked) if key.revoked else None,
            "state": key.state(now),
            "budget": str(key.budget) if key.budget is not None else None,
            "exempt": key.exempt,
        }
        for key in keys
    ]


def _iso(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


# --- effects ------------------------------------------------------------------------------------


def parse(text: str, path: Path) -> tuple[IssuedKey, ...]:
    try:
        return KeysDocument.model_validate_json(text, strict=True, by_name=False).keys
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "the document"
        raise KeysFileInvalid(f"{path}: {where}: {first['msg']}") from None


def load(path: Path) -> tuple[IssuedKey, ...]:
    """The issued keys; none when the file does not exist yet."""
    try:
        text = read_text(path, limit=READ_LIMIT)
    except FileNotFoundError:
        return ()
    except FileRefused as exc:
        raise KeysFileInvalid(str(exc)) from None
    return parse(text, path)


def save(path: Path, keys: Sequence[IssuedKey]) -> None:
    directory = ensure_dir(path.parent, DIR_MODE)
    os.chmod(directory, DIR_MODE)  # an existing directory too: it holds the digests
    document = KeysDocument(keys=tuple(keys))
    data = (document.model_dump_json(by_alias=True, indent=2) + "\n").encode()
    write_atomic(path, data, FILE_MODE)


def generate(
    name: str,
    now: datetime,
    expires: datetime | None,
    budget: int | None = None,
    *,
    exempt: bool = False,
) -> NewKey:
    """A fresh random key and its entry (not yet saved)."""
    secret = PREFIX + secrets.token_urlsafe(_RANDOM_BYTES)
    entry = IssuedKey(
        id="key_" + secrets.token_hex(_ID_BYTES),
        name=check_name(name),
        sha256=digest(secret).hex(),
        created=now,
        expires=expires,
        budget=budget,
        exempt=exempt,
    )
    return NewKey(secret, entry)


def create(
    path: Path,
    name: str,
    now: datetime,
    expires: datetime | None = None,
    budget: int | None = None,
    *,
    exempt: bool = False,
) -> NewKey:
    """Issue a key and save its entry; the caller shows NewKey.secret once and keeps nothing."""
    new = generate(name, now, expires, budget, exempt=exempt)
    with _locked(path):
        save(path, add(load(path), new.entry))
    return new


def names(path: Path) -> dict[str, str]:
    """Each key id's name (the fixed keys' too), for figures by key; none readable: the
    fixed keys only."""
    try:
        issued = load(path)
    except KeysFileInvalid:
        issued = ()
    return {"owner": "owner", "inference": "inference"} | {key.id: key.name for key in issued}


def set_budget(path: Path, ref: str, budget: int | None) -> IssuedKey:
    """Give a key its own daily token budget, or (None) the settings' default again."""
    if budget is not None and not 1 <= budget <= MAX_BUDGET:
        raise KeyRefused(f"a budget is 1 to {MAX_BUDGET} tokens a day, not {budget}")
    with _locked(path):
        before = load(path)
        target = find(before, ref)
        done = target.model_copy(update={"budget": budget})
        save(path, tuple(done if key.id == target.id else key for key in before))
    return done


def set_exempt(path: Path, ref: str, on: bool) -> IssuedKey:
    """Make a key exempt from the daily budget, or not; the gateway applies it within a second."""
    return _change(path, lambda keys: mark_exempt(keys, ref, on))


def revoke_key(path: Path, ref: str, now: datetime) -> IssuedKey:
    return _change(path, lambda keys: revoke(keys, ref, now))


def _change(
    path: Path,
    change: Callable[[tuple[IssuedKey, ...]], tuple[tuple[IssuedKey, ...], IssuedKey]],
) -> IssuedKey:
    """One pure change of the keys, read and written under the lock; the file is written only
    when the change changed something."""
    with _locked(path):
        before = load(path)
        after, done = change(before)
        if after != before:
            save(path, after)
    return done


def _locked(path: Path) -> FileLock:
    directory = ensure_dir(path.parent, DIR_MODE)
    return FileLock(directory / _LOCK)
