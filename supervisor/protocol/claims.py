"""claims.json: what each engine's start claimed of the machine's memory, shared by every worker.

Place: `<data>/memory/claims.json`, beside the engines' own directories. The memory plan's
ledger (memplan/ledger.py) is its only writer, under its lock; the host's page reads it to show
what is held. A claim is `{name, bytes, pid, pidStart, container, at}`: what it holds (`Held`,
the part every reader shows) and who holds it. A claim counts while its engine's status is in
HOLDING_STATES, which both the plan's overview and the page apply to the status files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MEMORY_DIR: Final = "memory"
CLAIMS: Final = "claims.json"
MAX_CLAIMS_FILE: Final = 4 * 1024 * 1024
# A status in one of these may have a container behind it, even with a stale heartbeat (a
# stopped worker's engine still runs); stopped and failed ones have none.
HOLDING_STATES: Final = frozenset({"starting", "running", "stopping"})


class Held(BaseModel):
    """What a claim holds: its engine's name and bytes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str = Field(min_length=1, strict=True)
    bytes: int = Field(ge=0, strict=True)


class Claim(Held):
    """One claim as the ledger writes it: what it holds, the worker that made it (its pid and
    that process's start time) and, once the start created one, its container."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    pid: int = Field(ge=1)
    pid_start: int = Field(ge=0, alias="pidStart")
    container: str | None = None
    at: str


class ClaimsFile(BaseModel):
    """The whole file: its schema version and its claims."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_version: int = Field(default=1, alias="schemaVersion")
    claims: list[Claim] = Field(default_factory=list)


def claims_path(data_dir: Path) -> Path:
    """Where a data directory's claims.json is."""
    return data_dir / MEMORY_DIR / CLAIMS


def parse_claims(text: str) -> list[Claim]:
    """The claims of the file's text, as its writer needs them: a text that is not such a
    file as a whole holds nothing."""
    try:
        return ClaimsFile.model_validate_json(text).claims
    except ValueError:
        return []


def held_claims(text: str) -> list[Held]:
    """What each claim of the file's text holds, read loosely, as a reader shows them: an entry
    that does not say its name and bytes is skipped, the others still show."""
    try:
        document = json.loads(text)
    except ValueError:
        return []
    entries = document.get("claims") if isinstance(document, dict) else None
    found = []
    for entry in entries if isinstance(entries, list) else []:
        try:
            found.append(Held.model_validate(entry))
        except ValidationError:
            continue
    return found


def dump_claims(claims: Sequence[Claim]) -> bytes:
    """The file's text for these claims, as the ledger writes it."""
    document = ClaimsFile(claims=list(claims)).model_dump(by_alias=True)
    return (json.dumps(document, indent=2) + "\n").encode()
