"""The Docker SDK's errors and values in the project's terms.

Errors split by what the caller does next, a container's attributes as a Container, GPUs as
device requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import docker.errors
import requests.exceptions
from docker.types import DeviceRequest

from supervisor.docker.spec import Container, Gpus
from supervisor.errors import Permanent, Transient


@contextmanager
def translated(what: str) -> Iterator[None]:
    """Docker's errors as the project's: an unreachable or slow daemon is Transient (tried
    again), a refusal Permanent."""
    try:
        yield
    except docker.errors.NotFound as exc:
        raise Permanent(f"{what}: {exc.explanation or exc}") from None
    except docker.errors.APIError as exc:
        if exc.status_code is not None and exc.status_code >= 500 and "connect" in str(exc).lower():
            raise Transient(f"{what}: docker is unavailable: {exc.explanation}") from None
        raise Permanent(f"{what}: {exc.explanation or exc}") from None
    except (requests.exceptions.ConnectionError, docker.errors.DockerException) as exc:
        raise Transient(f"{what}: docker is unavailable ({type(exc).__name__})") from None
    except requests.exceptions.Timeout:
        raise Transient(f"{what}: docker did not answer in time") from None


def container_from(attrs: dict[str, Any]) -> Container:
    """A container as the API's inspect or list describes it."""
    state = attrs.get("State") or {}
    ports = (attrs.get("HostConfig") or {}).get("PortBindings") or {}
    bindings = tuple(
        (binding.get("HostIp") or "0.0.0.0", int(binding.get("HostPort") or 0))  # noqa: S104
        for published in ports.values()
        for binding in (published or [])
    )
    return Container(
        id=attrs["Id"],
        name=str(attrs.get("Name", "")).lstrip("/"),
        image_id=attrs.get("Image", ""),
        status=state.get("Status", "unknown"),
        exit_code=int(state.get("ExitCode") or 0),
        oom_killed=bool(state.get("OOMKilled")),
        started_at=state.get("StartedAt", ""),
        labels=dict((attrs.get("Config") or {}).get("Labels") or {}),
        bindings=bindings,
    )


def device_requests(gpus: Gpus) -> list[DeviceRequest] | None:
    """A spec's GPUs as the API's device requests; None for none."""
    if gpus == "none":
        return None
    count = -1 if gpus == "all" else int(gpus)
    return [DeviceRequest(count=count, capabilities=[["gpu"]])]
