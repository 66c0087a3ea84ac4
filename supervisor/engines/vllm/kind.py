"""The vllm engine kind: a GPU (or CPU) server's catalog engine, `vllm serve` in its image."""

from __future__ import annotations

from supervisor.engines.kind import EngineKind
from supervisor.engines.vllm import memory
from supervisor.engines.vllm.recipe import VllmRecipe

KIND = EngineKind(
    name="vllm",
    recipe=VllmRecipe,
    engine="supervisor.engines.vllm.engine:Vllm",
    memory=memory.plan,
    conformance="tests.conformance.drivers.vllm",
)
