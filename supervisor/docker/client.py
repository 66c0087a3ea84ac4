"""The docker SDK's API client, made the same way for the worker and for the build child."""

from __future__ import annotations

from typing import cast

import docker


def api_client(base_url: str | None, timeout: float | None) -> docker.APIClient:
    """None means no timeout (docker wait, builds); the stubs only admit an int."""
    limit = cast(int, timeout)
    if base_url:
        return docker.APIClient(base_url=base_url, timeout=limit)
    return docker.from_env(timeout=limit).api
