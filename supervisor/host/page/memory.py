"""The memory section: the workers' plans and the ledger's claims against the limit, from files.

The host imports no memory plan (it knows no worker, engine or plan), so this reads what the
workers wrote: each engine's status.json `memory` (its plan: the need of a start, whether it
fits now and why not, the machine's limit and its source, the four reserves, when it was made),
`<data>/memory/claims.json` (each engine's claimed bytes, read by protocol/claims.py) and
/proc/meminfo (read by hw/meminfo.py, as the plan reads both). The limit and the
reserves are the newest plan's; with no plan published yet, the limit is MemTotal and the
reserves are unknown. An engine that holds memory (starting, running, stopping) counts with
its claim; any other engine shows its planned need, which counts against nothing. Free is the
limit less the reserves and what is held, negative when they are over it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from supervisor.host.proxy.catalog import Catalog
from supervisor.hw.meminfo import MEMINFO, MeminfoUnreadable, read_meminfo
from supervisor.protocol.claims import HOLDING_STATES, MAX_CLAIMS_FILE, claims_path, held_claims
from supervisor.protocol.documents import MemoryPlan, Status
from supervisor.protocol.files import FileRefused, read_text


def newest_plan(statuses: Mapping[str, Status | None]) -> tuple[str, MemoryPlan] | None:
    """Pure: the engine whose plan is the newest, and that plan; None when none has one. A
    tie goes to the first name, so the answer does not depend on the order of the files."""
    plans = [(name, s.memory) for name, s in sorted(statuses.items()) if s and s.memory]
    if not plans:
        return None
    return max(plans, key=lambda found: found[1].planned_at)


def outdated_by(statuses: Mapping[str, Status | None], name: str) -> str | None:
    """Pure: the engine whose state changed last after name's plan was made (what it holds,
    and so the verdict, may have changed since), or None when the plan is newer than every
    other engine's change. The page then does not hold a start back on that verdict."""
    status = statuses.get(name)
    plan = status.memory if status is not None else None
    if plan is None:
        return None
    later = [
        (other_status.since, other)
        for other, other_status in statuses.items()
        if other != name and other_status is not None and other_status.since > plan.planned_at
    ]
    return max(later)[1] if later else None


def _at(plan: MemoryPlan) -> str:
    """When the plan was made, as status.json writes it."""
    return str(plan.model_dump(mode="json", by_alias=True)["plannedAt"])


def _need(name: str, status: Status, plan: MemoryPlan, outdated: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "state": status.state,
        "need": plan.need,
        "fits": plan.fits,
        "message": plan.message,
        "plannedAt": _at(plan),
        "outdatedBy": outdated,
    }


def overview(
    statuses: Mapping[str, Status | None],
    claims: Sequence[tuple[str, int]],
    machine: tuple[int, int] | None,
) -> dict[str, Any] | None:
    """Pure: the section from the engines' statuses (by name), the ledger's claims and
    (MemTotal, MemAvailable); None when there is neither a plan nor a MemTotal to divide."""
    newest = newest_plan(statuses)
    if newest is None and machine is None:
        return None
    holding = {name for name, s in statuses.items() if s is not None and s.state in HOLDING_STATES}
    held = [(name, size) for name, size in claims if name in holding]
    needs, unplanned = [], []
    for name, status in sorted(statuses.items()):
        if status is None or status.state in HOLDING_STATES:
            continue
        if status.memory is None:
            unplanned.append(name)
        else:
            needs.append(_need(name, status, status.memory, outdated_by(statuses, name)))
    if newest is None:
        assert machine is not None
        limit, source, plan, reserves = machine[0], "meminfo", None, None
    else:
        name, chosen = newest
        limit, source = chosen.limit, chosen.limit_source
        plan = {"engine": name, "plannedAt": _at(chosen)}
        reserves = chosen.reserves.model_dump()
    reserved = sum(reserves.values()) if reserves else 0
    return {
        "limit": limit,
        "limitSource": source,
        "plan": plan,
        "reserves": reserves,
        "held": [{"name": name, "bytes": size} for name, size in held],
        "free": limit - reserved - sum(size for _, size in held),
        "needs": needs,
        "unplanned": unplanned,
        "availableNow": machine[1] if machine is not None else None,
    }


class LedgerMemory:
    """The memory source of a data directory: its engines' status files, its ledger."""

    def __init__(self, data_dir: Path, meminfo: Path = MEMINFO) -> None:
        self.data_dir = data_dir
        self.meminfo = meminfo
        self.catalog = Catalog(data_dir)

    def read(self) -> dict[str, Any] | None:
        machine: tuple[int, int] | None
        try:
            machine = read_meminfo(self.meminfo)
        except (OSError, FileRefused, MeminfoUnreadable):
            machine = None
        try:
            text = read_text(claims_path(self.data_dir), limit=MAX_CLAIMS_FILE)
        except (OSError, FileRefused):
            text = "{}"
        claims = [(held.name, held.bytes) for held in held_claims(text)]
        statuses = {engine.name: engine.status for engine in self.catalog.engines()}
        return overview(statuses, claims, machine)
