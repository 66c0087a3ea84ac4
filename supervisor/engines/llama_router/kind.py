"""The llama-router engine kind: llama.cpp's llama-server in router mode over the model library."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.engines.kind import EngineKind
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.library import ggufcheck
from supervisor.library.models import scan
from supervisor.memplan import router
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


def _memory(recipe: LlamaRouterRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    """Every Ready model of the library from its GGUF header; the startup set planned together."""
    opts = router.options(recipe.router.defaults)
    library = scan(recipe.library.models_path)
    units = [unit for model in library.models for unit in ggufcheck.group(model.files).units]
    models, bad = router.read_models(units)
    routed = router.plan(
        recipe.name, models, budget.left, recipe.router.load_on_startup, opts,
        multiplier=multiplier, unplannable=bad,
    )  # fmt: skip
    return EnginePlan(recipe.name, check(routed.startup, budget), router=routed)


KIND = EngineKind(
    name="llama-router",
    recipe=LlamaRouterRecipe,
    engine=_engine,
    memory=_memory,
    conformance="tests.conformance.drivers.llama_router",
)
