"""What one engine folder declares in one place: an EngineKind, its module's `KIND`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from supervisor.recipe.schema import RecipeBase

if TYPE_CHECKING:
    from supervisor.memplan.fit import Budget
    from supervisor.memplan.overview import EnginePlan

# (recipe, budget, weight multiplier) -> the plan `lucia-supervisor plan` shows for it
MemoryPlanner: TypeAlias = "Callable[[Any, Budget, float], EnginePlan]"


@dataclass(frozen=True)
class EngineKind:
    """An engine kind: the `engine = "..."` it answers to, its recipe schema, its engine class
    (`module:Class`, imported when an engine is made: knowing a kind costs no Docker import),
    how its memory need is planned, and the conformance suite's driver for it (a module path
    under tests/, imported only by the suite)."""

    name: str
    recipe: type[RecipeBase]
    engine: str
    memory: MemoryPlanner
    conformance: str

    def __post_init__(self) -> None:
        field = self.recipe.model_fields.get("engine")
        allowed = getattr(field.annotation, "__args__", ()) if field else ()
        if allowed != (self.name,):
            raise ValueError(
                f"engine kind {self.name!r}: its recipe {self.recipe.__name__} must declare "
                f'engine: Literal["{self.name}"]'
            )
