"""Engine modules: one per kind of engine, chosen by the recipe's `engine` field."""

from __future__ import annotations

from pathlib import Path

from ..recipe import LlamaRouterRecipe, Recipe, RecipeError, TensorFoldRecipe
from ..runtime import Runtime
from .base import Endpoint, Engine, StepContext


def create(
    name: str, recipe: Recipe, runtime: Runtime, state_dir: Path, data_dir: Path | None = None
) -> Engine:
    """data_dir: where the machine's memory claims are shared; None plans no memory."""
    if isinstance(recipe, TensorFoldRecipe):
        from .tensorfold import TensorFold

        return TensorFold(name, recipe, runtime, state_dir, data_dir)
    if isinstance(recipe, LlamaRouterRecipe):
        from .llama_router import LlamaRouter

        return LlamaRouter(name, recipe, runtime, state_dir, data_dir)
    # the vllm recipe, its preflight and its tiers exist; its worker engine does not yet
    raise RecipeError(
        f"{name}: engine {recipe.engine!r} has no worker in this version; "
        "run `lucia-supervisor plan` for its figures, or use tensorfold or llama-router"
    )


__all__ = ["Endpoint", "Engine", "StepContext", "create"]
