"""KV-cache tiers for vLLM: namespaced, owner-only directories and what the container gets.

The tiers (the context-cache note): GPU prefix caching (vLLM's own flag), a shared-memory
offload inside the container's /dev/shm, an NVMe hot copy and an HDD pool, each with a byte cap.
The tier plugin that writes the blocks is not ours; the supervisor gives it, through the
environment, where each tier is, its cap, the namespace and the cache key:

    LUCIA_KV_NAMESPACE   the namespace (below)           LUCIA_KV_KEY_ID  the key's id, not the key
    LUCIA_KV_SHM_DIR     /dev/shm/lucia-kv/<namespace>    LUCIA_KV_SHM_BYTES   its cap
    LUCIA_KV_NVME_DIR    /kv/nvme (the namespace's dir)   LUCIA_KV_NVME_BYTES  its cap
    LUCIA_KV_HDD_DIR     /kv/hdd                          LUCIA_KV_HDD_BYTES   its cap
    LUCIA_KV_DATA_PARALLEL_SIZE  --data-parallel-size, where over 1: a directory per rank
    LUCIA_KV_BUFFER_BYTES  its staging buffer     LUCIA_KV_QUEUE_BYTES  its write queue's bytes
    LUCIA_KV_KEY_FILE    a read-only 0400 file holding the cache key (secretfiles.py): the
                         key is never in the environment, the arguments or a log

A namespace is a digest of everything that makes an old block wrong: the model manifest (HF id
and pinned revision, or the library model's file digests), the vLLM image digest, the plugin
version, the key id (an HMAC of the key, so rotating the key changes the namespace without the
key being written anywhere), the KV layout (from the model's config.json), the parallel
configuration and the engine arguments that change what a block holds (the quantization, the
extra `vllm serve` arguments). Only the current namespace's directory is mounted, so the engine
never sees blocks of another; old namespaces are removed, oldest first, once the tier's cap
needs their room, and never one an engine holds, names or is starting on (namespaces.py).

The cache key is 64 hex digits (32 random bytes, `openssl rand -hex 32`); the plugin refuses
anything else with the same rule, so a recipe is refused here before an engine starts.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

KEY_CONTEXT: Final = b"lucia-supervisor kv-cache key id v1"
SHM_ROOT: Final = "/dev/shm/lucia-kv"
CONTAINER_ROOT: Final = "/kv"
KEY_RULE: Final = (
    "the cache key must be exactly 64 hex digits (32 random bytes: openssl rand -hex 32)"
)
_KEY = re.compile(r"[0-9a-fA-F]{64}")
_NAMESPACE = re.compile(r"[0-9a-f]{32}")
_DATA_PARALLEL = ("--data-parallel-size", "--data_parallel_size", "-dp")


class TierRefused(Exception):
    """A tier directory that is not safe to use; str() names it and the fix."""


@dataclass(frozen=True)
class KvLayout:
    dtype: str  # the KV cache dtype, e.g. "auto", "fp8"
    block_size: int
    layers: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True)
class Parallel:
    tensor: int = 1
    pipeline: int = 1
    data: int = 1  # --data-parallel-size: engine cores in one container, each its own directory


def data_parallel(args: Sequence[str]) -> int:
    """The data-parallel size the extra `vllm serve` arguments give (the last one wins, as in
    argparse); 1 without one, or with one that is not a number (vLLM refuses that itself)."""
    found = 1
    for at, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name not in _DATA_PARALLEL:
            continue
        if not equals:
            value = args[at + 1] if at + 1 < len(args) else ""
        if value.isdigit() and int(value) >= 1:
            found = int(value)
    return found


@dataclass(frozen=True)
class CacheIdentity:
    model_manifest: str
    image_digest: str
    plugin_version: str
    key_id: str
    layout: KvLayout
    parallel: Parallel
    engine_args: tuple[str, ...] = ()  # the quantization and the extra `vllm serve` arguments


def hf_manifest(repo_id: str, revision: str) -> str:
    return json.dumps({"hf": repo_id, "revision": revision}, sort_keys=True)


def library_manifest(guid: str, file_digests: Mapping[str, str]) -> str:
    return json.dumps(
        {"library": guid, "files": dict(sorted(file_digests.items()))}, sort_keys=True
    )


def key_refused(key: str) -> str | None:
    """Why the cache key cannot be used (the rule, never the key), or None."""
    return None if _KEY.fullmatch(key) else KEY_RULE


def key_id(key: str | bytes) -> str:
    """A stable id of the cache key that reveals nothing about it."""
    raw = key.encode() if isinstance(key, str) else key
    return hmac.new(raw, KEY_CONTEXT, hashlib.sha256).hexdigest()[:16]


def namespace(identity: CacheIdentity) -> str:
    canonical = json.dumps(asdict(identity), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class DiskTier:
    name: str  # "nvme" or "hdd": the environment names and the mount point
    root: Path  # on the host; the namespace directory is created below it
    max_bytes: int


@dataclass(frozen=True)
class TierPlan:
    shm_bytes: int  # the offload's cap inside /dev/shm
    shm_size: int  # the container's /dev/shm
    memory: int  # the container's memory limit (shm pages and the buffers count against it)
    disks: tuple[DiskTier, ...]
    data_parallel: int = 1  # vLLM's dense data-parallel ranks each report a size of 1
    buffer_bytes: int = 0  # the plugin's staging buffer in host memory; 0: its own default
    queue_bytes: int = 0  # the blocks waiting for the tiers' writers; 0: its own default


@dataclass(frozen=True)
class ContainerTiers:
    volumes: tuple[tuple[str, str], ...]  # (host dir, container dir), read-write
    environment: dict[str, str]
    shm_size: int
    memory: int


def container(plan: TierPlan, space: str, key_identity: str) -> ContainerTiers:
    """What the engine container is created with for these tiers (pure)."""
    env = {
        "LUCIA_KV_NAMESPACE": space,
        "LUCIA_KV_KEY_ID": key_identity,
        "LUCIA_KV_SHM_DIR": f"{SHM_ROOT}/{space}",
        "LUCIA_KV_SHM_BYTES": str(plan.shm_bytes),
    }
    if plan.data_parallel > 1:
        env["LUCIA_KV_DATA_PARALLEL_SIZE"] = str(plan.data_parallel)
    for name, value in (("BUFFER", plan.buffer_bytes), ("QUEUE", plan.queue_bytes)):
        if value:  # what the memory plan counted is what the plugin holds
            env[f"LUCIA_KV_{name}_BYTES"] = str(value)
    volumes = []
    for tier in plan.disks:
        target = f"{CONTAINER_ROOT}/{tier.name}"
        volumes.append((str(tier.root / space), target))
        env[f"LUCIA_KV_{tier.name.upper()}_DIR"] = target
        env[f"LUCIA_KV_{tier.name.upper()}_BYTES"] = str(tier.max_bytes)
    return ContainerTiers(tuple(volumes), env, plan.shm_size, plan.memory)


def _check(fd: int, path: Path, uid: int) -> None:
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode):
        raise TierRefused(f"{path} is not a directory")
    if info.st_uid != uid:
        raise TierRefused(
            f"{path} is owned by uid {info.st_uid}, not {uid}; chown it or pick another tier path"
        )
    if info.st_mode & 0o077:
        raise TierRefused(
            f"{path} has mode {stat.S_IMODE(info.st_mode):04o}, open to others; chmod 700 {path}"
        )


def _open_dir(path: Path, dir_fd: int | None = None) -> int:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    target = path.name if dir_fd is not None else str(path)
    try:
        return os.open(target, flags, dir_fd=dir_fd)
    except OSError as exc:
        if os.path.islink(path):
            raise TierRefused(
                f"{path} is a symbolic link; tier paths must be real directories"
            ) from None
        raise TierRefused(f"{path}: {exc.strerror}") from None


def _make_root(root: Path, uid: int) -> None:
    """Create the tier root and any missing parents with mode 0700. Another worker may create
    one at the same time (two engines on one root, started together): that one must be a real
    directory of the worker's user, closed to group and others (as the tier plugin's are)."""
    missing = []
    here = root
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            _check_made_by_another(path, uid)
            continue
        os.chmod(path, 0o700, follow_symlinks=False)  # whatever the umask says


def _check_made_by_another(path: Path, uid: int) -> None:
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise TierRefused(
            f"{path} appeared and is not a directory; tier paths must be real directories"
        )
    if info.st_uid != uid or info.st_mode & 0o077:
        raise TierRefused(
            f"{path} appeared with owner {info.st_uid} and mode "
            f"{stat.S_IMODE(info.st_mode):04o}; it must be owned by uid {uid} with mode 0700"
        )


def open_root(root: Path, uid: int | None = None) -> int:
    """The tier root, created owner-only where missing, opened and checked (a real directory
    of the worker's user, closed to others): its descriptor, for the caller to close."""
    if not root.is_absolute():
        raise TierRefused(f"{root} must be an absolute path")
    owner = os.geteuid() if uid is None else uid
    _make_root(root, owner)
    fd = _open_dir(root)
    try:
        _check(fd, root, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def prepare(root: Path, space: str, uid: int | None = None) -> Path:
    """The namespace's directory under a tier root, created owner-only (mode 0700).

    Refuses a root or namespace directory that is a symlink, owned by another user or open to
    group or others. Returns the namespace directory (what is mounted)."""
    if not _NAMESPACE.fullmatch(space):
        raise TierRefused(f"{space!r} is not a namespace")
    owner = os.geteuid() if uid is None else uid
    root_fd = open_root(root, owner)
    try:
        directory = root / space
        created = True
        try:
            os.mkdir(space, 0o700, dir_fd=root_fd)
        except FileExistsError:
            created = False
        fd = _open_dir(directory, root_fd)
        try:
            if created:
                os.fchmod(fd, 0o700)  # whatever the umask says
            _check(fd, directory, owner)
        finally:
            os.close(fd)
        return directory
    finally:
        os.close(root_fd)


def stale(root: Path, space: str) -> list[Path]:
    """Namespace directories under a tier root other than the current one (old model
    revisions, images, layouts or keys): blocks that must never be reused."""
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [root / name for name in names if _NAMESPACE.fullmatch(name) and name != space]
