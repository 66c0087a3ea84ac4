"""The vllm engine kind: a GPU (or CPU) server's catalog engine, `vllm serve` in its image."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.engines.kind import EngineKind
from supervisor.engines.vllm import memory
from supervisor.engines.vllm.recipe import VllmRecipe

if TYPE_CHECKING:
    from supervisor.docker.runtime import Runtime
    from supervisor.engines.base import Engine


def _engine(
    name: str, recipe: VllmRecipe, runtime: Runtime, state_dir: Path, data_dir: Path | None
) -> Engine:
    from supervisor.engines.vllm.engine import Vllm  # the Docker side, when made

    return Vllm(name, recipe, runtime, state_dir, data_dir)


KIND = EngineKind(
    name="vllm",
    recipe=VllmRecipe,
    engine=_engine,
    memory=memory.plan,
    conformance="tests.conformance.drivers.vllm",
)
