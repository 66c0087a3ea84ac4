"""The vLLM server's own answers, read over HTTP: readiness, its version, its tiers' state."""

from __future__ import annotations

import errno
import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Final

from supervisor.engines.vllm import tasks

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


def routes(base: str) -> tuple[str, ...] | None:
    """The paths the server's `/openapi.json` names (the routes of its tasks); None when it
    does not answer them (not up yet, or `--disable-fastapi-docs`)."""
    try:
        return tasks.routes(json.loads(get(base + "/openapi.json")[1].decode()))
    except (OSError, ValueError, urllib.error.URLError):
        return None


class Routes:
    """vLLM's routes, read once per container: until they answer, each look asks again."""

    def __init__(self) -> None:
        self._seen: tuple[str, tuple[str, ...]] | None = None  # (container id, its routes)

    def of(self, container_id: str, base: str) -> tuple[str, ...] | None:
        if self._seen is not None and self._seen[0] == container_id:
            return self._seen[1]
        found = routes(base)
        if found is not None:
            self._seen = (container_id, found)
        return found


_SAMPLE: Final = re.compile(
    r"^lucia_kv_tier_(off|on)_total\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$", re.MULTILINE
)
_LABEL: Final = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_REASON: Final = re.compile(r"[a-z0-9_]{1,32}")
TIERS_EVERY: Final = 10.0  # seconds between two reads of the engine's /metrics for the tiers


def tiers_off(metrics: str) -> dict[str, tuple[str, ...]]:
    """The KV tiers the plugin has switched off, from vLLM's /metrics text: a tier is off while
    it was switched off more often than it opened again (summed over the engine's ranks), with
    the reasons it was switched off for (errno names, such as erofs)."""
    offs: dict[str, float] = {}
    ons: dict[str, float] = {}
    reasons: dict[str, set[str]] = {}
    for match in _SAMPLE.finditer(metrics):
        labels = dict(_LABEL.findall(match["labels"]))
        tier, value = labels.get("tier", ""), float(match["value"])
        if not tier or value <= 0:
            continue
        if match[1] == "off":
            offs[tier] = offs.get(tier, 0) + value
            reason = labels.get("reason", "")
            if _REASON.fullmatch(reason):
                reasons.setdefault(tier, set()).add(reason)
        else:
            ons[tier] = ons.get(tier, 0) + value
    return {
        tier: tuple(sorted(reasons.get(tier, ())))
        for tier, count in offs.items()
        if count > ons.get(tier, 0)
    }


def tiers_note(off: dict[str, tuple[str, ...]]) -> str:
    """What the status message says of tiers that are off: `tier nvme off: read-only file
    system` (the reasons in the errno's own words)."""
    parts = []
    for tier in sorted(off):
        words = "; ".join(_words(reason) for reason in off[tier]) or "a fault"
        parts.append(f"tier {tier} off: {words}")
    return ", ".join(parts)


def _words(reason: str) -> str:
    number = getattr(errno, reason.upper(), None) if reason.startswith("e") else None
    return os.strerror(number).lower() if isinstance(number, int) else reason.replace("_", " ")


class TierWatch:
    """Which tiers the running engine has switched off, read from its /metrics at most every
    TIERS_EVERY seconds (the last answer is kept in between; none while it does not answer)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._read_at = float("-inf")
        self._note = ""

    def note(self, base: str | None) -> str:
        """What the status says of the tiers of the engine at `base` (None: no engine)."""
        if base is None:
            return ""
        now = self._clock()
        if now - self._read_at < TIERS_EVERY:
            return self._note
        self._read_at = now
        try:
            status, body = get(base + "/metrics")
        except (OSError, urllib.error.URLError):
            self._note = ""
            return ""
        self._note = tiers_note(tiers_off(body.decode(errors="replace"))) if status == 200 else ""
        return self._note
