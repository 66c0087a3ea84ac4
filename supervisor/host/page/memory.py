"""The memory the host can show: the ledger's claims against the machine's memory, from files.

The host imports no memory plan (the layers put it below the plan), so this reads what the
workers wrote: `<data>/memory/claims.json` (each engine's claimed need, `name` and `bytes`)
and /proc/meminfo (MemTotal as the limit, MemAvailable as what is free now). The reserves
and a plan for an engine that does not run are the plan's (`lucia-supervisor plan`), so they
are not shown here. A claim whose engine's status says it cannot hold memory is left out, as
the plan leaves it out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from supervisor.host.protocol import BadName, engine_dir, load_status
from supervisor.protocol.files import FileRefused, read_text

CLAIMS: Final = Path("memory") / "claims.json"
MEMINFO: Final = Path("/proc/meminfo")
HOLDING: Final = frozenset({"starting", "running", "stopping"})
_LIMIT: Final = 4 * 1024 * 1024


def parse_meminfo(text: str) -> tuple[int, int] | None:
    """Pure: (MemTotal, MemAvailable) in bytes, or None when either is missing."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        number, _, unit = rest.strip().partition(" ")
        if key in {"MemTotal", "MemAvailable"} and number.isdigit():
            found[key] = int(number) * (1024 if unit == "kB" else 1)
    if len(found) != 2:
        return None
    return found["MemTotal"], found["MemAvailable"]


def parse_claims(text: str) -> list[tuple[str, int]]:
    """Pure: the (name, bytes) of each well-formed claim; anything else is skipped."""
    try:
        document = json.loads(text)
    except ValueError:
        return []
    claims = document.get("claims") if isinstance(document, dict) else None
    found = []
    for claim in claims if isinstance(claims, list) else []:
        if not isinstance(claim, dict):
            continue
        name, size = claim.get("name"), claim.get("bytes")
        if isinstance(name, str) and type(size) is int and size >= 0:
            found.append((name, size))
    return found


class LedgerMemory:
    """The memory source of a data directory."""

    def __init__(self, data_dir: Path, meminfo: Path = MEMINFO) -> None:
        self.data_dir = data_dir
        self.meminfo = meminfo

    def _holds(self, name: str) -> bool:
        try:
            status = load_status(engine_dir(self.data_dir, name))
        except BadName:
            return False
        return status is not None and status.state in HOLDING

    def read(self) -> dict[str, Any] | None:
        try:
            machine = parse_meminfo(read_text(self.meminfo, limit=_LIMIT))
        except (OSError, FileRefused):
            machine = None
        if machine is None:
            return None
        try:
            text = read_text(self.data_dir / CLAIMS, limit=_LIMIT)
        except (OSError, FileRefused):
            text = "{}"
        claims = [(n, b) for n, b in parse_claims(text) if self._holds(n)]
        limit, available = machine
        claimed = sum(size for _, size in claims)
        return {
            "limit": limit,
            "limitSource": "host MemTotal (/proc/meminfo)",
            "availableNow": available,
            "claims": [{"name": name, "bytes": size} for name, size in claims],
            "unclaimed": max(0, limit - claimed),
            "reserves": None,  # the plan's; `lucia-supervisor plan` shows them
        }
