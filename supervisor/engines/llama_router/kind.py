"""The llama-router engine kind: llama.cpp's llama-server in router mode over the model library."""

from __future__ import annotations

from supervisor.engines.kind import EngineKind
from supervisor.engines.llama_router import plan
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe

KIND = EngineKind(
    name="llama-router",
    recipe=LlamaRouterRecipe,
    engine="supervisor.engines.llama_router.engine:LlamaRouter",
    memory=plan.engine_plan,
    conformance="tests.conformance.drivers.llama_router",
)
