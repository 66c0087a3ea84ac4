"""The vllm start's memory need: its container's memory limit on a CPU, its GPU share on a GPU.

vLLM sizes itself from what it is given, not from the model: on a CPU the container's limit
(`run.memory`, which holds the KV cache of `kv_cache_gib` and /dev/shm) is all it may take; on
a GPU it takes `memory` percent of each GPU's memory (`--gpu-memory-utilization`). Either is
counted once, as it is: the weights multiplier calibrates GGUF file sizes, not a limit.
"""

from __future__ import annotations

from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.memplan.fit import Budget, Fits, Verdict, check
from supervisor.memplan.need import EngineNeed, figures
from supervisor.memplan.overview import EnginePlan


def cpu_need(recipe: VllmRecipe) -> EngineNeed | None:
    """The container's memory limit; None when the recipe gives none (a GPU recipe may not)."""
    limit = recipe.memory_limit
    if limit is None:
        return None
    return _need(recipe, limit, "Lower run.memory")


def cpu_fit(recipe: VllmRecipe, limit: int, reserves: int) -> Verdict | None:
    """Whether run.memory fits the machine at all (its limit less the reserves, nothing held):
    the check a CPU start passes before its image is pulled. None when nothing is planned."""
    need = cpu_need(recipe)
    if need is None:
        return None
    return check(need, Budget(limit, reserves))


def refused(verdict: Verdict | None) -> str | None:
    """The refusal's message, or None when it fits (or nothing was planned)."""
    return None if verdict is None or isinstance(verdict, Fits) else verdict.message


def gpu_need(recipe: VllmRecipe, gpu_total: int) -> EngineNeed:
    """The recipe's share of gpu_total bytes (the GPUs' memory, the limit on a GPU server)."""
    return _need(recipe, gpu_total * recipe.vllm.memory // 100, "Lower vllm.memory")


def _need(recipe: VllmRecipe, total: int, lower: str) -> EngineNeed:
    model = figures(recipe.model or recipe.vllm.served_name, total, 0,
                    recipe.vllm.max_model_len, multiplier=1.0, kv=0)  # fmt: skip
    return EngineNeed(recipe.name, (model,), lower)


def plan(recipe: VllmRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    """What `lucia-supervisor plan` shows: on a GPU server the budget's limit is the GPUs'."""
    if recipe.vllm.device == "cpu":
        need = cpu_need(recipe)
        if need is None:  # the recipe's own check requires run.memory on a CPU
            return EnginePlan(recipe.name, None, "the recipe gives no run.memory")
    else:
        need = gpu_need(recipe, budget.limit)
    return EnginePlan(recipe.name, check(need, budget))
