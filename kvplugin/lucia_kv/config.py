"""The store's configuration: one typed value, resolved in one place (arguments, then env)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

from . import version

TIER_NAMES: Final = ("shm", "nvme", "hdd")  # fastest first
ENV_PREFIX: Final = "LUCIA_KV_"
KEY_HEX_DIGITS: Final = 64  # 32 random bytes, what `openssl rand -hex 32` prints
KEY_RULE: Final = (
    f"the cache key must be exactly {KEY_HEX_DIGITS} hex digits (32 random bytes: "
    "openssl rand -hex 32)"
)
_KEY = re.compile(rb"[0-9a-fA-F]{%d}" % KEY_HEX_DIGITS)
_NAMESPACE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_DEFAULTS: Final[Mapping[str, int | float]] = {
    "writers": 2,
    "queue_blocks": 1024,
    "queue_bytes": 256 * 1024 * 1024,
    "buffer_bytes": 256 * 1024 * 1024,
    "rebuild_max_entries": 1_000_000,
    "rebuild_max_seconds": 30.0,
    "retry_seconds": 5.0,
    "data_parallel_size": 1,
}


class ConfigError(ValueError):
    """The configuration cannot be used; str() says which setting and why (never the key)."""


@dataclass(frozen=True)
class TierSpec:
    name: str  # "shm", "nvme" or "hdd"
    directory: Path
    max_bytes: int


@dataclass(frozen=True)
class StoreConfig:
    namespace: str
    plugin_version: str
    tiers: tuple[TierSpec, ...]  # fastest first
    key: bytes = field(repr=False)  # the 32 bytes the hex digits name
    writers: int = 2
    queue_blocks: int = 1024
    queue_bytes: int = 256 * 1024 * 1024  # every tier's queued blocks, each counted once
    buffer_bytes: int = 256 * 1024 * 1024  # the host buffer of a step's moves (whole blocks)
    rebuild_max_entries: int = 1_000_000
    rebuild_max_seconds: float = 30.0  # then the rest is indexed while the engine serves
    retry_seconds: float = 5.0  # the first back-off before a tier that failed is tried again
    metrics_file: Path | None = None
    data_parallel_size: int = 1  # vLLM's --data-parallel-size (a dense model's ranks say 1)
    rank: str = ""  # the parallel rank's share (for_rank), "" for a whole engine


def parse_key(text: bytes) -> bytes:
    """The 32-byte cache key from its file's text (surrounding space ignored); ConfigError
    naming the rule, never the text, for anything but 64 hex digits."""
    text = text.strip()
    if not _KEY.fullmatch(text):
        raise ConfigError(f"{KEY_RULE}; LUCIA_KV_KEY_FILE or LUCIA_KV_KEY")
    return bytes.fromhex(text.decode())


def _setting(name: str, extra: Mapping[str, object], environ: Mapping[str, str]) -> object:
    if name in extra and extra[name] is not None:
        return extra[name]
    return environ.get(ENV_PREFIX + name.upper())


def _number(name: str, value: object, kind: type[int] | type[float]) -> int | float:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number, not {value!r}")
    try:
        number = kind(str(value))
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, not {value!r}") from None
    if number < 0:
        raise ConfigError(f"{name} must not be negative, got {number}")
    return number


def _read_key(extra: Mapping[str, object], environ: Mapping[str, str]) -> bytes:
    if "key" in extra:
        raise ConfigError(
            "the cache key must not be in kv_connector_extra_config (it would reach argv); "
            "give key_file or LUCIA_KV_KEY_FILE"
        )
    key_file = _setting("key_file", extra, environ)
    if key_file:
        path = Path(str(key_file))
        try:
            with path.open("rb") as handle:
                info = os.fstat(handle.fileno())
                if info.st_mode & 0o077:
                    raise ConfigError(
                        f"key file {path} has mode {stat.S_IMODE(info.st_mode):04o}; "
                        f"chmod 600 {path}"
                    )
                text = handle.read(4096)
        except OSError as exc:
            raise ConfigError(f"key file {path}: {exc.strerror}") from None
    else:
        text = environ.get(ENV_PREFIX + "KEY", "").encode()
    return parse_key(text)


def tiers(
    extra: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[TierSpec, ...]:
    """The tiers that are on, fastest first, from the same settings as resolve() (no key:
    for a process that names the tiers but holds no store)."""
    extra = {} if extra is None else extra
    environ = os.environ if environ is None else environ
    found = []
    for name in TIER_NAMES:
        directory = _setting(f"{name}_dir", extra, environ)
        cap = _setting(f"{name}_bytes", extra, environ)
        if not directory:
            continue
        path = Path(str(directory))
        if not path.is_absolute():
            raise ConfigError(f"{name}_dir must be an absolute path, got {path}")
        size = int(_number(f"{name}_bytes", cap if cap is not None else 0, int))
        if size > 0:
            found.append(TierSpec(name, path, size))
    if not found:
        raise ConfigError("no tier has both a directory and a byte cap above 0")
    return tuple(found)


def resolve(
    extra: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> StoreConfig:
    """The configuration from kv_connector_extra_config (wins) and the environment.

    Settings: namespace, key_file (or LUCIA_KV_KEY), <tier>_dir and <tier>_bytes for the tiers
    shm, nvme and hdd (a tier without a directory or with 0 bytes is off), writers,
    queue_blocks (per tier), queue_bytes, buffer_bytes, rebuild_max_entries, rebuild_max_seconds,
    retry_seconds, metrics_file, data_parallel_size."""
    extra = {} if extra is None else extra
    environ = os.environ if environ is None else environ
    space = str(_setting("namespace", extra, environ) or "")
    if not _NAMESPACE.fullmatch(space):
        raise ConfigError(
            f"namespace {space!r} is missing or not 1-128 of [A-Za-z0-9._-] (LUCIA_KV_NAMESPACE)"
        )
    found = tiers(extra, environ)
    numbers: dict[str, int | float] = {}
    for name, default in _DEFAULTS.items():
        value = _setting(name, extra, environ)
        numbers[name] = default if value is None else _number(name, value, type(default))
    for name in ("writers", "data_parallel_size"):
        if numbers[name] < 1:
            raise ConfigError(f"{name} must be at least 1")
    if numbers["buffer_bytes"] < 1:
        raise ConfigError(
            "buffer_bytes must be at least 1 (the host buffer a step's KV blocks pass through; "
            "it holds at least one block)"
        )
    metrics = _setting("metrics_file", extra, environ)
    return StoreConfig(
        namespace=space,
        plugin_version=version(),
        tiers=found,
        key=_read_key(extra, environ),
        writers=int(numbers["writers"]),
        queue_blocks=int(numbers["queue_blocks"]),
        queue_bytes=int(numbers["queue_bytes"]),
        buffer_bytes=int(numbers["buffer_bytes"]),
        rebuild_max_entries=int(numbers["rebuild_max_entries"]),
        rebuild_max_seconds=float(numbers["rebuild_max_seconds"]),
        retry_seconds=float(numbers["retry_seconds"]),
        metrics_file=Path(str(metrics)) if metrics else None,
        data_parallel_size=int(numbers["data_parallel_size"]),
    )


def for_rank(
    config: StoreConfig, rank: int, ranks: int, dp_rank: int = 0, dp_size: int = 1
) -> StoreConfig:
    """The share of one parallel rank: its own subdirectory of each tier and an equal part of
    each cap. Each data-parallel engine (dp<n>) and, in it, each tensor or pipeline rank
    (rank<n>) holds its own blocks, owns its index alone and seals under a key of its own
    (sealing.py): two never share a directory. vLLM runs a dense model's data-parallel ranks
    as independent engines that each report a size of 1 (keeping their index), so the size
    is also taken from the configuration's data_parallel_size."""
    dp_size = max(dp_size, config.data_parallel_size, dp_rank + 1)
    parts = [f"dp{dp_rank}"] if dp_size > 1 else []
    parts += [f"rank{rank}"] if ranks > 1 else []
    if not parts:
        return config
    share = max(1, ranks) * dp_size
    tiers = tuple(
        TierSpec(t.name, t.directory.joinpath(*parts), t.max_bytes // share) for t in config.tiers
    )
    return replace(config, tiers=tiers, rank="/".join(parts))
