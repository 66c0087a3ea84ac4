"""The memory ledger: what each lucia engine holds, shared by every worker of the machine.

Place: `<data>/memory/claims.json` (the host's data directory, beside the engines' own
directories), guarded by an exclusive flock on `<data>/memory/.claims.lock`. Protocol: a worker
about to start takes the lock, reads the claims, drops those that no longer hold anything,
decides with what the others hold, records its own claim when it fits, writes the file
atomically (files.write_atomic) and only then lets go of the lock. So two workers starting at
once are serialised: the second sees the first one's claim.

A claim is `{name, bytes, pid, pidStart, container, at}`. It holds while its engine runs (the
caller passes the names of the running lucia engines it observed), or while the worker that
made it is alive (same pid and the same start time in /proc/<pid>/stat, so a reused pid does
not count) and no container is attached yet: a start in progress holds before its container
exists. Once attached, a claim holds only while its engine runs, so an engine that stops or
exits frees its memory with no release. A stopped worker's engine still runs and so still
holds. A worker releases its claim when its start fails before a container exists, or when
the start will not follow (a stop or a newer request came first).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from supervisor.memplan.fit import Holding, Verdict
from supervisor.protocol.documents import utc_now
from supervisor.protocol.files import FileLock, FileRefused, ensure_dir, read_text, write_atomic

MEMORY_DIR: Final = "memory"
CLAIMS: Final = "claims.json"
LOCK: Final = ".claims.lock"
MAX_CLAIMS_FILE: Final = 4 * 1024 * 1024


class Claim(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    name: str = Field(min_length=1)
    bytes: int = Field(ge=0)
    pid: int = Field(ge=1)
    pid_start: int = Field(ge=0, alias="pidStart")
    container: str | None = None
    at: str


class _ClaimsFile(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_version: int = Field(default=1, alias="schemaVersion")
    claims: list[Claim] = Field(default_factory=list)


def process_start(pid: int) -> int | None:
    """The process's start time (clock ticks after boot, /proc/<pid>/stat field 22), or None
    when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            text = handle.read().decode(errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def alive(claim: Claim) -> bool:
    return process_start(claim.pid) == claim.pid_start


@dataclass(frozen=True)
class Ledger:
    """The claims in <data>/memory/; every method takes and releases the lock itself."""

    directory: Path

    @classmethod
    def for_data_dir(cls, data_dir: Path) -> Ledger:
        return cls(data_dir / MEMORY_DIR)

    @property
    def path(self) -> Path:
        return self.directory / CLAIMS

    def _lock(self) -> FileLock:
        ensure_dir(self.directory)
        return FileLock(self.directory / LOCK)

    def _read(self) -> list[Claim]:
        try:
            text = read_text(self.path, limit=MAX_CLAIMS_FILE)
            return _ClaimsFile.model_validate_json(text).claims
        except FileNotFoundError:
            return []
        except (FileRefused, ValidationError, ValueError):
            return []  # an unreadable ledger holds nothing; the "now" check still guards

    def _write(self, claims: list[Claim]) -> None:
        document = _ClaimsFile(claims=claims).model_dump(by_alias=True)
        write_atomic(self.path, (json.dumps(document, indent=2) + "\n").encode())

    @staticmethod
    def _live(claims: list[Claim], running: Collection[str]) -> list[Claim]:
        return [
            claim
            for claim in claims
            if claim.name in running or (claim.container is None and alive(claim))
        ]

    def held(self, running: Collection[str], exclude: str | None = None) -> tuple[Holding, ...]:
        """What the claims that still hold say, other than exclude's; changes nothing."""
        with self._lock():
            claims = self._live(self._read(), running)
        return tuple(Holding(c.name, c.bytes) for c in claims if c.name != exclude)

    def claims(self) -> tuple[Claim, ...]:
        with self._lock():
            return tuple(self._read())

    def claim(
        self,
        name: str,
        running: Collection[str],
        decide: Callable[[tuple[Holding, ...]], Verdict],
        container: str | None = None,
        pid: int | None = None,
    ) -> Verdict:
        """Decide with what the others hold and, when it fits, record name's claim of the
        verdict's need; both under the lock. name's earlier claim is replaced, not counted."""
        pid = pid or os.getpid()
        start = process_start(pid)
        if start is None:
            raise ValueError(f"no process {pid} to hold the claim")
        with self._lock():
            before = self._read()
            claims = [c for c in self._live(before, running) if c.name != name]
            verdict = decide(tuple(Holding(c.name, c.bytes) for c in claims))
            if verdict.fits:
                claims.append(
                    Claim(
                        name=name,
                        bytes=verdict.need.need,
                        pid=pid,
                        pidStart=start,
                        container=container,
                        at=utc_now().isoformat(),
                    )
                )
            else:
                claims += [c for c in before if c.name == name]  # a refusal changes nothing
            if claims != before:
                self._write(claims)
        return verdict

    def attach(self, name: str, container: str) -> bool:
        """Record the container a claim's start created; whether name had a claim."""
        with self._lock():
            claims = self._read()
            found = [c for c in claims if c.name == name]
            if not found:
                return False
            updated = [c.model_copy(update={"container": container}) if c.name == name else c
                       for c in claims]  # fmt: skip
            self._write(updated)
        return True

    def release(self, name: str) -> bool:
        """Drop name's claim (its engine stopped, or its start failed); whether there was one."""
        with self._lock():
            claims = self._read()
            kept = [c for c in claims if c.name != name]
            if len(kept) != len(claims):
                self._write(kept)
        return len(kept) != len(claims)
