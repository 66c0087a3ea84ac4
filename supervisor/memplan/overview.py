"""The plan of named engines without starting anything: what `lucia-supervisor plan` prints.

Each engine is planned against the limit less the reserves and what the other engines' claims
hold (the engine's own claim is not counted against itself), by the planner the caller gives:
the engine registry's, which asks the recipe's kind (a tensorfold engine from its recipe's
[memory] section, a llama-router from the GGUF headers of its library's Ready models). The
memory plan knows no engine: engines import it, never the other way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeAlias

from supervisor.library.models import LibraryUnavailable
from supervisor.memplan.fit import Budget, Holding, Verdict, size
from supervisor.memplan.ledger import Ledger
from supervisor.memplan.need import ModelNeed
from supervisor.memplan.probe import Memory
from supervisor.memplan.settings import MachineSettings
from supervisor.protocol.claims import HOLDING_STATES
from supervisor.protocol.layout import BadName, engine_dir
from supervisor.protocol.reads import load_status
from supervisor.recipe.schema import Recipe


def held_from_files(data_dir: Path) -> tuple[Holding, ...]:
    """What the ledger's claims hold, read from files only (the host has no Docker): a claim
    holds while its engine's status.json says it may run, or while its start is in progress."""
    ledger = Ledger.for_data_dir(data_dir)
    if not ledger.path.is_file():
        return ()
    running = set()
    for claim in ledger.claims():
        try:
            status = load_status(engine_dir(data_dir, claim.name))
        except BadName:
            continue
        if status is not None and status.state in HOLDING_STATES:
            running.add(claim.name)
    return ledger.held(running=running)


class SkippedModel(Protocol):
    """A model left out of the plan because its files could not be read, and why."""

    @property
    def name(self) -> str: ...
    @property
    def reason(self) -> str: ...


class OfferedModels(Protocol):
    """An engine's models beyond its start (the llama-router's plan): what the overview shows."""

    @property
    def offered(self) -> Sequence[ModelNeed]: ...
    @property
    def unfit(self) -> Sequence[ModelNeed]: ...  # cannot fit even alone: not offered
    @property
    def unplannable(self) -> Sequence[SkippedModel]: ...


@dataclass(frozen=True)
class EnginePlan:
    name: str
    verdict: Verdict | None  # None: the engine could not be planned
    problem: str = ""
    router: OfferedModels | None = None  # a llama-router's models, each planned alone

    @property
    def fits(self) -> bool:
        return (
            self.verdict is not None
            and self.verdict.fits
            and not (self.router and self.router.unfit)
        )


@dataclass(frozen=True)
class Overview:
    memory: Memory
    settings: MachineSettings
    held: tuple[Holding, ...]
    engines: tuple[EnginePlan, ...]

    @property
    def fits(self) -> bool:
        return all(engine.fits for engine in self.engines)


# (recipe, budget, weight multiplier) -> its plan; the registry's `plan_memory` in the CLI
Planner: TypeAlias = Callable[[Recipe, Budget, float], EnginePlan]


def build(
    recipes: Sequence[Recipe],
    settings: MachineSettings,
    memory: Memory,
    held: Sequence[Holding],
    planner: Planner,
) -> Overview:
    plans = []
    for recipe in recipes:
        others = tuple(h for h in held if h.name != recipe.name)
        budget = Budget(memory.limit, settings.reserves.total, others, memory.host)
        try:
            plans.append(planner(recipe, budget, settings.weight_multiplier))
        except (OSError, ValueError, LibraryUnavailable) as exc:
            plans.append(EnginePlan(recipe.name, None, str(exc)))
    return Overview(memory, settings, tuple(held), tuple(plans))


def _rows(plan: EnginePlan) -> list[dict[str, Any]]:
    rows = []
    if plan.verdict is not None:
        for model in plan.verdict.need.models:
            rows.append(_model_row(plan.name, model, "start"))
    if plan.router is not None:
        started = {m.name for m in plan.verdict.need.models} if plan.verdict else set()
        rows += [
            _model_row(plan.name, m, "offered")
            for m in plan.router.offered
            if m.name not in started
        ]
        rows += [_model_row(plan.name, m, "does not fit alone") for m in plan.router.unfit]
        rows += [
            {"engine": plan.name, "model": bad.name, "role": f"unreadable: {bad.reason}"}
            for bad in plan.router.unplannable
        ]
    return rows


def _model_row(engine: str, model: ModelNeed, role: str) -> dict[str, Any]:
    return {
        "engine": engine,
        "model": model.name,
        "role": role,
        "weights": model.weights,
        "kvBytesPerToken": model.kv_per_token,
        "context": model.context,
        "need": model.need,
    }


def as_json(overview: Overview) -> dict[str, Any]:
    reserves = overview.settings.reserves
    return {
        "fits": overview.fits,
        "limit": overview.memory.limit,
        "limitSource": overview.memory.source,
        "available": overview.memory.available,
        "reserves": {
            "os": reserves.os,
            "services": reserves.services,
            "voice": reserves.voice,
            "runtime": reserves.runtime,
            "total": reserves.total,
        },
        "weightMultiplier": overview.settings.weight_multiplier,
        "held": [{"name": h.name, "bytes": h.bytes} for h in overview.held],
        "engines": [
            {
                "name": plan.name,
                "fits": plan.fits,
                "need": plan.verdict.need.need if plan.verdict else None,
                "left": plan.verdict.left if plan.verdict else None,
                "message": plan.verdict.message if plan.verdict else plan.problem,
                "models": _rows(plan),
            }
            for plan in overview.engines
        ],
    }


def render(overview: Overview) -> str:
    """The human table: per engine and model, then the limit, reserves, held and left."""
    header = ("ENGINE", "MODEL", "ROLE", "WEIGHTS", "KV B/TOKEN", "CONTEXT", "NEED")
    table: list[tuple[str, ...]] = [header]
    for plan in overview.engines:
        for row in _rows(plan):
            if "need" not in row:
                table.append((row["engine"], row["model"], row["role"], "-", "-", "-", "-"))
                continue
            table.append(
                (
                    row["engine"],
                    row["model"],
                    row["role"],
                    f"{size(row['weights'])}",
                    str(row["kvBytesPerToken"]),
                    str(row["context"]),
                    f"{size(row['need'])}",
                )
            )
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in table
    ]
    memory, reserves = overview.memory, overview.settings.reserves
    held = ", ".join(f"{h.name} {size(h.bytes)}" for h in overview.held) or "nothing"
    lines += [
        "",
        f"limit     {size(memory.limit)} ({memory.source}); available now {size(memory.available)}",
        f"reserves  {size(reserves.total)} (os {size(reserves.os)}, services "
        f"{size(reserves.services)}, voice {size(reserves.voice)}, "
        f"runtime {size(reserves.runtime)})",
        f"held      {held}",
    ]
    for plan in overview.engines:
        if plan.verdict is None:
            lines.append(f"{plan.name}: cannot be planned: {plan.problem}")
            continue
        verdict = plan.verdict
        state = "fits" if plan.fits else "does not fit"
        lines.append(
            f"{plan.name}: {state}: needs {size(verdict.need.need)}, {size(verdict.left)} left"
        )
        if verdict.message:
            lines.append(f"  {verdict.message}")
        if plan.router and plan.router.unfit:
            names = ", ".join(m.name for m in plan.router.unfit)
            lines.append(f"  not offered (cannot fit even alone): {names}")
    return "\n".join(lines)
