"""The llama-router's plan from the library's GGUF headers, before any sync.

The kind's memory planner (what `lucia-supervisor plan` shows) and the routing the engine's look
plans with. No Docker: the plan command runs on a host without it.
"""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.library import ggufcheck
from supervisor.library import models as library
from supervisor.library.ggufcheck import Unit
from supervisor.memplan import router
from supervisor.memplan.fit import Budget, check
from supervisor.memplan.overview import EnginePlan


def units(found: library.Library) -> list[Unit]:
    """Each Ready library model's units, from its own files (no cache): what the plan reads."""
    return [unit for model in found.models for unit in ggufcheck.group(model.files).units]


def route(
    name: str,
    recipe: LlamaRouterRecipe,
    read: tuple[Sequence[router.RouterModel], Sequence[router.Unplannable]],
    room: int,
    multiplier: float,
) -> router.RouterPlan:
    """The router plan of these read headers in room: each model alone, the load-on-startup
    set together. The router defaults' ValueError says what is wrong with them."""
    models, bad = read
    return router.plan(
        name, models, room, recipe.router.load_on_startup, router.options(recipe.router.defaults),
        multiplier=multiplier, unplannable=bad,
    )  # fmt: skip


def engine_plan(recipe: LlamaRouterRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    """Every Ready model of the library from its GGUF header; the startup set planned together
    (the kind's planner: what `lucia-supervisor plan` shows)."""
    router.options(recipe.router.defaults)  # refused before any header is read
    read = router.read_models(units(library.scan(recipe.library.models_path)))
    routed = route(recipe.name, recipe, read, budget.left, multiplier)
    return EnginePlan(recipe.name, check(routed.startup, budget), router=routed)
