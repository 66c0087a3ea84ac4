"""The tensorfold engine kind: the Spark recipe's checkout, prepare, grammar image, container."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.engines.kind import EngineKind
from supervisor.engines.tensorfold import memory
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe

if TYPE_CHECKING:
    from supervisor.docker.runtime import Runtime
    from supervisor.engines.base import Engine


def _engine(
    name: str, recipe: TensorFoldRecipe, runtime: Runtime, state_dir: Path, data_dir: Path | None
) -> Engine:
    from supervisor.engines.tensorfold.engine import TensorFold  # the Docker side, when made

    return TensorFold(name, recipe, runtime, state_dir, data_dir)


KIND = EngineKind(
    name="tensorfold",
    recipe=TensorFoldRecipe,
    engine=_engine,
    memory=memory.plan,
    conformance="tests.conformance.drivers.tensorfold",
)
