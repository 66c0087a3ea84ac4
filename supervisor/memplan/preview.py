"""The plan a worker publishes: what a start of its recipe would need now, claiming nothing.

The same two checks as the Check step's claim (guard.py): the plan's, against the limit, the
reserves and what the other engines hold, then the memory free now (this engine's own claim
is credited while its container runs, as a replacement's is). Nothing is written to the
ledger. status.json carries the result as `memory`; the host shows it and plans nothing itself.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from supervisor.errors import Permanent, Transient
from supervisor.library.models import LibraryUnavailable
from supervisor.memplan import settings
from supervisor.memplan.fit import Budget, check, check_now
from supervisor.memplan.guard import Guard, running_engines
from supervisor.memplan.need import EngineNeed
from supervisor.memplan.probe import Memory, ProbeFailed
from supervisor.protocol.documents import MemoryPlan, Reserves, clean_message, utc_now

NOT_PLANNED = "the recipe gives nothing to plan a start from: its start is not checked for memory"


# what a start would need in this budget with this weight multiplier; None: the start is not planned
Need = Callable[[Budget, float], EngineNeed | None]


def preview(guard: Guard, need: Need, clock: Callable[[], datetime] = utc_now) -> MemoryPlan | None:
    """The plan of a start now; None when the machine cannot be measured or its settings are
    refused (the Check step says why, when a start is asked for)."""
    try:
        machine = settings.load()
        memory = guard.measure(machine)
        running = running_engines(guard.runtime)
        held = guard.ledger.held(running, exclude=guard.name)
        own = guard.own_claim()
    except (settings.MachineError, Permanent, Transient, ProbeFailed, OSError):
        return None
    releasing = own if guard.name in running else 0
    reserves = machine.reserves.total

    def plan(need: int | None, fits: bool, message: str) -> MemoryPlan:
        return _plan(memory, machine.reserves, clock(), need, fits=fits, message=message)

    budget = Budget(memory.limit, reserves, held, memory.host)
    try:
        wanted = need(budget, machine.weight_multiplier)
    except (Permanent, OSError, ValueError, LibraryUnavailable) as exc:
        return plan(None, False, str(exc))
    if wanted is None:
        return plan(None, True, NOT_PLANNED)
    verdict = check(wanted, budget)
    if verdict.fits:
        verdict = check_now(wanted, memory.available, reserves, releasing)
    return plan(wanted.need, verdict.fits, verdict.message)


def _plan(
    memory: Memory,
    reserves: settings.MachineReserves,
    when: datetime,
    need: int | None,
    *,
    fits: bool,
    message: str,
) -> MemoryPlan:
    return MemoryPlan(
        need=need,
        fits=fits,
        message=clean_message(message),
        limit=memory.limit,
        limit_source=memory.source,
        reserves=Reserves(
            os=reserves.os,
            services=reserves.services,
            voice=reserves.voice,
            runtime=reserves.runtime,
        ),
        planned_at=when,
    )
