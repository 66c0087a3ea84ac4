"""Secrets as read-only files: what `docker inspect` shows is a path, never the value.

Each one is a 0400 file in a 0700 directory of its own, mounted read-only, with its path in the
environment.

huggingface_hub reads its token from `HF_TOKEN_PATH`; the KV tier plugin reads its cache key
from `LUCIA_KV_KEY_FILE`. A directory, not the file, is mounted: a rewritten file (a new inode) is
then what the container reads too. Any other secret stays in the environment (vLLM has no file
form for it; docs/recipes/vllm.md says so).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor.docker.spec import Mount
from supervisor.protocol import files

CONTAINER_ROOT: Final = "/run/lucia-secrets"
VALUE: Final = "value"
TOKEN_PATH: Final = "HF_TOKEN_PATH"  # noqa: S105 (a variable name)
KEY_FILE: Final = "LUCIA_KV_KEY_FILE"


@dataclass(frozen=True)
class SecretFiles:
    environment: dict[str, str]  # the path variables
    mounts: tuple[Mount, ...]  # each secret's directory, read-only


def plan(root: Path, names: Mapping[str, str]) -> SecretFiles:
    """Pure: for each secret name with a file form (name -> its path variable), where its file
    is on the host (root/<name>/value) and in the container."""
    env: dict[str, str] = {}
    mounts = []
    for name, variable in sorted(names.items()):
        target = f"{CONTAINER_ROOT}/{name}"
        mounts.append(Mount(str(root / name), target, read_only=True))
        env.setdefault(variable, f"{target}/{VALUE}")
    return SecretFiles(env, tuple(mounts))


def write(root: Path, values: Mapping[str, str]) -> None:
    """Write each value to root/<name>/value (0400; directories 0700), atomically, only when
    it differs from what is there."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    for name, value in values.items():
        directory = root / name
        directory.mkdir(mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        path = directory / VALUE
        with contextlib.suppress(OSError):
            if path.read_text() == value + "\n" and (path.stat().st_mode & 0o777) == 0o400:
                continue
        files.write_atomic(path, (value + "\n").encode(), 0o400)
