"""The tensorfold start's memory need, from the recipe's own measurements ([memory])."""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.engines.tensorfold.recipe import TensorFoldRecipe
from supervisor.memplan.fit import Budget, check
from supervisor.memplan.need import EngineNeed, figures
from supervisor.memplan.overview import EnginePlan
from supervisor.memplan.settings import gib


@dataclass(frozen=True)
class TensorfoldFigures:
    """A tensorfold start's figures, from the recipe's own measurements (bytes)."""

    weights: int
    kv_per_token: int
    kv: int | None = None  # the whole KV cache, when the recipe gives it instead


def recipe_figures(recipe: TensorFoldRecipe) -> TensorfoldFigures | None:
    """The figures of the recipe's [memory] section; None when it has none. A per-token KV
    figure counts for CONTEXT x PARALLEL tokens."""
    found = recipe.memory
    if found is None:
        return None
    if found.kv_gib is not None:
        return TensorfoldFigures(gib(found.weights_gib), 0, gib(found.kv_gib))
    per_token = found.kv_bytes_per_token or 0
    settings = recipe.settings
    tokens = int(settings.get("CONTEXT", 0)) * int(settings.get("PARALLEL", 1))
    return TensorfoldFigures(gib(found.weights_gib), per_token, per_token * tokens)


def tensorfold_need(
    recipe: TensorFoldRecipe, found: TensorfoldFigures, multiplier: float = 1.0
) -> EngineNeed:
    """The weights figure is the engine's measured startup estimate: counted once (the
    multiplier calibrates GGUF file sizes, not measurements)."""
    settings = recipe.settings
    context = int(settings.get("CONTEXT", 0))
    parallel = int(settings.get("PARALLEL", 1))
    model = figures(
        recipe.model,
        found.weights,
        found.kv_per_token,
        context,
        parallel=parallel,
        multiplier=multiplier,
        kv=found.kv,
    )
    return EngineNeed(recipe.name, (model,), "Lower CONTEXT")


def plan(recipe: TensorFoldRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    """What `lucia-supervisor plan` shows (the multiplier does not apply to measurements)."""
    found = recipe_figures(recipe)
    if found is None:
        return EnginePlan(recipe.name, None, "the recipe gives no memory figures")
    return EnginePlan(recipe.name, check(tensorfold_need(recipe, found), budget))
