"""The tensorfold engine kind: the Spark recipe's checkout, prepare, grammar image, container."""

from __future__ import annotations

from supervisor.engines.kind import EngineKind
from supervisor.engines.tensorfold import memory
from supervisor.engines.tensorfold.recipe import TensorFoldRecipe

KIND = EngineKind(
    name="tensorfold",
    recipe=TensorFoldRecipe,
    engine="supervisor.engines.tensorfold.engine:TensorFold",
    memory=memory.plan,
    conformance="tests.conformance.drivers.tensorfold",
)
