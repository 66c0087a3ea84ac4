"""The vllm engine kind: a GPU (or CPU) server's catalog engine, `vllm serve` in its image."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.engines.kind import EngineKind
from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.memplan.fit import Budget
from supervisor.memplan.overview import EnginePlan

if TYPE_CHECKING:
    from supervisor.docker.runtime import Runtime
    from supervisor.engines.base import Engine


def _engine(
    name: str, recipe: VllmRecipe, runtime: Runtime, state_dir: Path, data_dir: Path | None
) -> Engine:
    from supervisor.engines.vllm.engine import Vllm  # the Docker side, when made

    return Vllm(name, recipe, runtime, state_dir, data_dir)


def _memory(recipe: VllmRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    return EnginePlan(recipe.name, None, "the vllm engine is not planned yet")


KIND = EngineKind(
    name="vllm",
    recipe=VllmRecipe,
    engine=_engine,
    memory=_memory,
    conformance="tests.conformance.drivers.vllm",
)
