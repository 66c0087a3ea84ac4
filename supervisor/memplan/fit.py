"""Does a start fit: the plan's budget and the memory free now, and the refusal's wording.

The plan: need <= limit - reserves - held by others (the ledger's claims of running engines).
Now: need <= available (MemAvailable, or the GPUs' free memory) - reserves + releasing (what a
replacement frees when it stops the old engine). Both must hold; memory used outside lucia
shows only in the second. The wording is the operators' guide's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from supervisor.memplan.need import EngineNeed, ModelNeed
from supervisor.memplan.settings import GIB

AFTER: Final = "does not fit after voice, OS, services, and runtime reservations"


@dataclass(frozen=True)
class Holding:
    """What another running engine holds, by its claim."""

    name: str
    bytes: int


@dataclass(frozen=True)
class Budget:
    limit: int
    reserves: int
    held: tuple[Holding, ...] = ()
    host: bool = True  # the limit is host memory (MemTotal or a fixed figure), not the GPUs'

    @property
    def held_total(self) -> int:
        return sum(holding.bytes for holding in self.held)

    @property
    def left(self) -> int:
        """What a start may use: the limit less the reserves and what others hold."""
        return self.limit - self.reserves - self.held_total


@dataclass(frozen=True)
class Fits:
    need: EngineNeed
    left: int
    fits: bool = True
    message: str = ""
    waitable: bool = False


@dataclass(frozen=True)
class Refused:
    need: EngineNeed
    left: int
    message: str
    fits: bool = False
    waitable: bool = False  # what others hold or use is in the way: it may pass by waiting


Verdict = Fits | Refused


def gib(value: int) -> str:
    return f"{value / GIB:.1f}"


def size(value: int) -> str:
    """Bytes for people: GiB from 1 GiB, MiB and KiB below (tiny models), 0 B for nothing."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(value) >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value} B"


def _names(names: Sequence[str]) -> str:
    if len(names) <= 1:
        return "".join(names)
    return ", ".join(names[:-1]) + " or " + names[-1]


def _has_context(model: ModelNeed) -> bool:
    """A model with a KV cache needs some context (an "auto" plan of 0 tokens does not fit)."""
    return model.context > 0 or model.embedding or model.kv_per_token == 0


def _amount(value: int, show: Callable[[int], str]) -> str:
    return f"{show(value)} GiB" if show is gib else show(value)


def _of_which(need: EngineNeed) -> str:
    """The need's named shares, e.g. " (of which the context cache's host buffers 512.0 MiB)"."""
    said = ", ".join(f"{name} {size(value)}" for name, value in need.shares if value)
    return f" (of which {said})" if said else ""


def check(need: EngineNeed, budget: Budget) -> Verdict:
    """The plan's check against the limit, the reserves and what others hold."""
    left = budget.left
    if need.need <= left and all(_has_context(model) for model in need.models):
        return Fits(need, left)
    show = gib if budget.limit >= GIB else size  # the guide's GiB figures; tiny test limits
    details = [f"limit {show(budget.limit)}", f"reserves {show(budget.reserves)}"]
    if budget.held:
        held = ", ".join(f"{h.name} {show(h.bytes)}" for h in budget.held)
        details.append(f"held by {held}")
    advice = need.lower
    if budget.held:
        advice += f" or stop {_names([h.name for h in budget.held])}"
    message = (
        f"{need.subject} {AFTER}: needs {_amount(need.need, show)}{_of_which(need)}, "
        f"{_amount(left, show)} left "
        f"({', '.join(details)}). {advice}."
    )
    alone = need.need <= budget.limit - budget.reserves  # fits once the others let go
    return Refused(need, left, message, waitable=bool(budget.held) and alone)


def check_now(need: EngineNeed, available: int, reserves: int, releasing: int = 0) -> Verdict:
    """The check against the memory free now (what lucia does not account for counts too)."""
    left = available + releasing - reserves
    if need.need <= left:
        return Fits(need, left)
    freed = f", freed by the replacement {gib(releasing)}" if releasing else ""
    message = (
        f"{need.subject} {AFTER} in the memory free now: needs {gib(need.need)} GiB"
        f"{_of_which(need)}, "
        f"{gib(left)} GiB left (available {gib(available)}, reserves {gib(reserves)}{freed}). "
        f"{need.lower} or free memory outside lucia."
    )
    return Refused(need, left, message, waitable=True)
