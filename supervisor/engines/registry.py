"""The engine registry: the engine class for a recipe, chosen by its `engine` field."""

from __future__ import annotations

from pathlib import Path

from supervisor.docker.runtime import Runtime
from supervisor.engines.base import Engine
from supervisor.recipe.schema import LlamaRouterRecipe, Recipe, TensorFoldRecipe


def create(
    name: str, recipe: Recipe, runtime: Runtime, state_dir: Path, data_dir: Path | None = None
) -> Engine:
    """data_dir: where the machine's memory claims are shared; None plans no memory."""
    if isinstance(recipe, TensorFoldRecipe):
        from supervisor.engines.tensorfold.engine import TensorFold

        return TensorFold(name, recipe, runtime, state_dir, data_dir)
    if isinstance(recipe, LlamaRouterRecipe):
        from supervisor.engines.llama_router.engine import LlamaRouter

        return LlamaRouter(name, recipe, runtime, state_dir, data_dir)
    from supervisor.engines.vllm.engine import Vllm

    return Vllm(name, recipe, runtime, state_dir, data_dir)


