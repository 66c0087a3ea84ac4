"""What containers and images are, in the project's own terms (no Docker import here).

`RunSpec.fingerprint()` is the one place that says what a container is created with: any change
to it, field by field, means the running container is not what the recipe now says.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from supervisor.docker import labels

_DIGEST: Final = 12  # hex digits per field: enough to tell settings apart, short enough to read


@dataclass(frozen=True)
class Container:
    id: str
    name: str
    image_id: str
    status: str  # created, running, paused, restarting, removing, exited, dead
    exit_code: int
    oom_killed: bool
    started_at: str
    labels: Mapping[str, str]
    bindings: tuple[tuple[str, int], ...]  # (host ip, host port) for every published port

    @property
    def running(self) -> bool:
        return self.status in ("running", "restarting", "paused")

    @property
    def managed(self) -> bool:
        return self.labels.get(labels.MANAGED) == "true"


@dataclass(frozen=True)
class Image:
    id: str
    labels: Mapping[str, str]


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = False


Gpus = Literal["all", "none"] | int


@dataclass(frozen=True)
class RunSpec:
    name: str
    image: str
    network: str
    host_ip: str
    host_port: int
    container_port: int
    environment: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    command: tuple[str, ...] = ()
    gpus: Gpus = "none"
    shm_size: str | None = None
    memory: str | None = None
    ipc_mode: str | None = None
    ulimits: Mapping[str, int] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    user: str | None = None  # "uid:gid" the container runs as; None: the image's own user

    def fingerprint(self) -> str:
        """Per setting a short digest, as `image=…,command=…,…`: stored as a container label,
        so that a later observation can say which settings changed."""
        return ",".join(f"{key}={_digest(value)}" for key, value in self._settings().items())

    def _settings(self) -> dict[str, object]:
        # the user only when one is set: containers created before it existed stay as they are
        user: dict[str, object] = {} if self.user is None else {"user": self.user}
        return {
            "image": self.image,
            "command": list(self.command),
            "environment": dict(sorted(self.environment.items())),
            "ports": [self.network, self.host_ip, self.host_port, self.container_port],
            "gpus": self.gpus,
            "limits": [
                self.shm_size,
                self.memory,
                self.ipc_mode,
                dict(sorted(self.ulimits.items())),
            ],
            "mounts": [[m.source, m.target, m.read_only] for m in self.mounts],
            "labels": {k: v for k, v in sorted(self.labels.items()) if k not in labels.BOOKKEEPING},
            **user,
        }


def changed_settings(created_with: str, wanted: str) -> tuple[str, ...]:
    """Pure: the settings whose digests differ between two fingerprints (all, if unreadable)."""
    before, after = _parse(created_with), _parse(wanted)
    return tuple(key for key in after if before.get(key) != after[key])


def _parse(fingerprint: str) -> dict[str, str]:
    pairs = (part.partition("=") for part in fingerprint.split(",") if part)
    return {key: value for key, _, value in pairs}


def _digest(value: object) -> str:
    blob = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:_DIGEST]


@dataclass(frozen=True)
class BuildRequest:
    """A classic-builder build: either a directory context or an in-memory Dockerfile."""

    tag: str
    labels: Mapping[str, str]
    context: str | None = None
    dockerfile: str = "Dockerfile"
    dockerfile_text: str | None = None
    build_args: Mapping[str, str] = field(default_factory=dict)
    nocache: bool = False  # every step run again, none taken from the build cache
