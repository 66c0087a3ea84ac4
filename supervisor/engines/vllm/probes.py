"""The vLLM server's own answers, read over HTTP: readiness and the version it reports."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Final

TIMEOUT: Final = 2.0
_VERSION: Final = re.compile(r"[0-9A-Za-z.+_-]{1,64}")


def get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=TIMEOUT) as response:  # noqa: S310
        return int(response.status), response.read()


def ready(base: str, ready_path: str, served: str) -> bool:
    """`ready_path` (/health) answers 200, then `/v1/models` lists the served name."""
    try:
        if get(base + ready_path)[0] != 200:
            return False
        listing = json.loads(get(base + "/v1/models")[1].decode())
    except (OSError, ValueError, urllib.error.URLError):
        return False
    data = listing.get("data") if isinstance(listing, dict) else None
    return any(isinstance(m, dict) and m.get("id") == served for m in data or [])


def version(base: str) -> str | None:
    """What `/version` says, when it looks like a version: status.json carries a version,
    never what else an answer holds."""
    try:
        found = json.loads(get(base + "/version")[1].decode()).get("version")
    except (OSError, ValueError, AttributeError, urllib.error.URLError):
        return None
    return found if isinstance(found, str) and _VERSION.fullmatch(found) else None


class Versions:
    """vLLM's `/version`, read once per container: until it answers (the server is up once the
    model loaded), each look asks again, with the probe's short timeout."""

    def __init__(self) -> None:
        self._seen: tuple[str, str] | None = None  # (container id, its /version)

    def of(self, container_id: str, base: str) -> str | None:
        if self._seen is not None and self._seen[0] == container_id:
            return self._seen[1]
        found = version(base)
        if found is not None:
            self._seen = (container_id, found)
        return found
