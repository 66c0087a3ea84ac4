"""The vllm start's memory need: its container's memory limit on a CPU, its GPU share on a GPU.

vLLM sizes itself from what it is given, not from the model: on a CPU the container's limit
(`run.memory`, which holds the KV cache of `kv_cache_gib` and /dev/shm) is all it may take; on
a GPU it takes `memory` percent of each GPU's memory (`--gpu-memory-utilization`). Either is
counted once, as it is: the weights multiplier calibrates GGUF file sizes, not a limit.

With [tiers] on, the tier plugin holds host memory of its own in the container: its staging
buffer and write queue (`tiers.buffer_bytes` + `tiers.queue_bytes`), and the shm tier in the
container's /dev/shm. The container's limit (`memory_limit`) is run.memory plus the buffers, and
run.memory already holds /dev/shm, so a CPU start counts the shm tier once, inside it. A GPU
start's share is of the GPUs' memory, which holds neither: both are added to it where the plan's
limit is host memory (a unified-memory machine, or a fixed figure), and not where it is the GPUs'
memory alone (`limit = "gpu"`), which host memory is no part of.
"""

from __future__ import annotations

from typing import Final

from supervisor.engines.vllm.recipe import VllmRecipe
from supervisor.memplan.fit import Budget, Fits, Verdict, check
from supervisor.memplan.need import EngineNeed, figures
from supervisor.memplan.overview import EnginePlan

CACHE_SHARE: Final = "the context cache's host buffers"


def cpu_need(recipe: VllmRecipe) -> EngineNeed | None:
    """The container's memory limit; None when the recipe gives none (a GPU recipe may not)."""
    limit = recipe.memory_limit
    if limit is None:
        return None
    return _need(recipe, limit, "Lower run.memory", cache_bytes(recipe, shm=False))


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


def gpu_need(recipe: VllmRecipe, gpu_total: int, *, host: bool = True) -> EngineNeed:
    """The recipe's share of gpu_total bytes (the GPUs' memory, the limit on a GPU server),
    plus the context cache's host memory where the limit is host memory too (host)."""
    cache = cache_bytes(recipe, shm=True) if host else 0
    return _need(recipe, gpu_total * recipe.vllm.memory // 100 + cache, "Lower vllm.memory", cache)


def cache_bytes(recipe: VllmRecipe, *, shm: bool) -> int:
    """Pure: the context cache's host memory: the plugin's buffers, and the shm tier where it
    is not counted yet (shm); 0 with the tiers off."""
    tiers = recipe.tiers
    return tiers.host_bytes + ((tiers.shm_bytes or 0) if shm and tiers.any else 0)


def _need(recipe: VllmRecipe, total: int, lower: str, cache: int = 0) -> EngineNeed:
    """total holds cache, the context cache's share, which a refusal names."""
    model = figures(
        recipe.model or recipe.vllm.served_name,
        total,
        0,
        recipe.vllm.max_model_len,
        multiplier=1.0,
        kv=0,
    )
    shares = ((CACHE_SHARE, cache),) if cache else ()
    return EngineNeed(recipe.name, (model,), lower, shares)


def plan(recipe: VllmRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    """What `lucia-supervisor plan` shows: on a GPU server the budget's limit is the GPUs'."""
    if recipe.vllm.device == "cpu":
        need = cpu_need(recipe)
        if need is None:  # the recipe's own check requires run.memory on a CPU
            return EnginePlan(recipe.name, None, "the recipe gives no run.memory")
    else:
        need = gpu_need(recipe, budget.limit, host=budget.host)
    return EnginePlan(recipe.name, check(need, budget))
