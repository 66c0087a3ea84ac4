"""The memory ledger: what each lucia engine holds, shared by every worker of the machine.

Place: `<data>/memory/claims.json` (the host's data directory, beside the engines' own
directories), guarded by an exclusive flock on `<data>/memory/.claims.lock`. Protocol: a worker
about to start takes the lock, reads the claims, drops those that no longer hold anything,
decides with what the others hold, records its own claim when it fits, writes the file
atomically (files.write_atomic) and only then lets go of the lock. So two workers starting at
once are serialised: the second sees the first one's claim.

A claim (its format is protocol/claims.py: the host's page reads the file too) holds while its
engine runs (the caller passes the names of the running lucia engines it observed), or while the
worker that made it is alive (same pid and the same start time in /proc/<pid>/stat, so a reused
pid does not count) and no container is attached yet: a start in progress holds before its
container exists. Once attached, a claim holds only while its engine runs, so an engine that
stops or exits frees its memory with no release. A stopped worker's engine still runs and so
still holds. A worker releases its claim when its start fails before a container exists, or
when the start will not follow (a stop or a newer request came first).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from supervisor.memplan.fit import Holding, Verdict
from supervisor.protocol.claims import (
    CLAIMS,
    MAX_CLAIMS_FILE,
    MEMORY_DIR,
    Claim,
    dump_claims,
    parse_claims,
)
from supervisor.protocol.documents import utc_now
from supervisor.protocol.files import FileLock, FileRefused, ensure_dir, read_text, write_atomic

LOCK: Final = ".claims.lock"


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
        """The claims on file; an unreadable ledger holds nothing (the "now" check still
        guards)."""
        try:
            return parse_claims(read_text(self.path, limit=MAX_CLAIMS_FILE))
        except (FileNotFoundError, FileRefused, ValueError):
            return []

    def _write(self, claims: list[Claim]) -> None:
        write_atomic(self.path, dump_claims(claims))

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
            updated = [
                c.model_copy(update={"container": container}) if c.name == name else c
                for c in claims
            ]
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
