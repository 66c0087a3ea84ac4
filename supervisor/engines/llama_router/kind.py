"""The llama-router engine kind: llama.cpp's llama-server in router mode over the model library."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.engines.kind import EngineKind
from supervisor.engines.llama_router import plan as router
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.library import ggufcheck
from supervisor.library import models as library
from supervisor.library.ggufcheck import Unit
from supervisor.memplan.fit import Budget, check
from supervisor.memplan.overview import EnginePlan

if TYPE_CHECKING:
    from supervisor.docker.runtime import Runtime
    from supervisor.engines.base import Engine


def _engine(
    name: str, recipe: LlamaRouterRecipe, runtime: Runtime, state_dir: Path, data_dir: Path | None
) -> Engine:
    from supervisor.engines.llama_router.engine import LlamaRouter  # the Docker side, when made

    return LlamaRouter(name, recipe, runtime, state_dir, data_dir)


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


def _memory(recipe: LlamaRouterRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    """Every Ready model of the library from its GGUF header; the startup set planned together."""
    router.options(recipe.router.defaults)  # refused before any header is read
    read = router.read_models(units(library.scan(recipe.library.models_path)))
    routed = route(recipe.name, recipe, read, budget.left, multiplier)
    return EnginePlan(recipe.name, check(routed.startup, budget), router=routed)


KIND = EngineKind(
    name="llama-router",
    recipe=LlamaRouterRecipe,
    engine=_engine,
    memory=_memory,
    conformance="tests.conformance.drivers.llama_router",
)
