"""The llama-router's plan: every Ready library model from its GGUF header, and the
load-on-startup set planned together; the kind's planner (what `lucia-supervisor plan` shows)
and the routing the engine's look plans with. No Docker: the plan command runs on a host
without it.

A model's weights are the sizes of all its split shards plus its mmproj file; its KV shape comes
from shard 1's header (ggufmeta reads the KV pairs only). Each model is planned alone in the
room left (`ctx-size = "auto"` in the router's defaults becomes that planned context, at most
native); a model that cannot fit even alone is not offered and is named. The load-on-startup
models are planned together: the room after all their weights is split evenly between their
KV caches, and that set is what the router's start claims (or, with none at start, its largest
offered model: the first request loads at least one).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, cast

from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.library import ggufcheck
from supervisor.library import models as library
from supervisor.library.ggufcheck import Unit, Unreadable
from supervisor.library.ggufmeta import BadHeader, read_metadata
from supervisor.memplan.fit import Budget, check
from supervisor.memplan.kv import CACHE_TYPES, CacheType, KvShape, NotAModel, shape
from supervisor.memplan.need import Context, EngineNeed, ModelNeed, plan_model, share_room
from supervisor.memplan.overview import EnginePlan

ADVICE: Final = "Lower ctx-size or load fewer models at start"
DefaultValue = str | int | float | bool


@dataclass(frozen=True)
class RouterModel:
    """One servable unit's figures read from disk."""

    name: str
    weights: int
    shape: KvShape


@dataclass(frozen=True)
class Unplannable:
    name: str
    reason: str


@dataclass(frozen=True)
class Options:
    """The router defaults that change the KV cache (llama-server's argument names)."""

    context: Context = "auto"
    parallel: int = 1
    type_k: CacheType = "f16"
    type_v: CacheType = "f16"


@dataclass(frozen=True)
class RouterPlan:
    offered: tuple[ModelNeed, ...]
    unfit: tuple[ModelNeed, ...]
    unplannable: tuple[Unplannable, ...]
    startup: EngineNeed

    def contexts(self) -> dict[str, int]:
        """The per-model ctx-size for the preset (what "auto" became)."""
        return {model.name: model.context for model in self.offered}


def options(defaults: Mapping[str, DefaultValue]) -> Options:
    """ctx-size (or c), parallel (or np), cache-type-k / cache-type-v from the defaults."""
    context = defaults.get("ctx-size", defaults.get("c", "auto"))
    parallel = defaults.get("parallel", defaults.get("np", 1))
    types = [defaults.get(key, "f16") for key in ("cache-type-k", "cache-type-v")]
    if context != "auto" and (not isinstance(context, int) or isinstance(context, bool)):
        raise ValueError(f'router ctx-size must be a number of tokens or "auto", not {context!r}')
    if not isinstance(parallel, int) or isinstance(parallel, bool) or parallel < 1:
        raise ValueError(f"router parallel must be a positive number, not {parallel!r}")
    bad = [value for value in types if value not in CACHE_TYPES]
    if bad:
        raise ValueError(f"KV cache type {bad[0]!r} is not one of {', '.join(CACHE_TYPES)}")
    chosen: Context = "auto" if context == "auto" else int(context)
    return Options(chosen, parallel, cast(CacheType, types[0]), cast(CacheType, types[1]))


def read_model(unit: Unit) -> RouterModel:
    """A unit's weights (shards + mmproj, by size) and KV shape (shard 1's header)."""
    weights = sum(os.stat(path, follow_symlinks=False).st_size for path in unit.files)
    return RouterModel(unit.name, weights, shape(read_metadata(unit.main)))


def read_models(units: Iterable[Unit]) -> tuple[list[RouterModel], list[Unplannable]]:
    models, bad = [], []
    for unit in units:
        try:
            models.append(read_model(unit))
        except (BadHeader, NotAModel, ValueError) as exc:
            bad.append(Unplannable(unit.name, str(exc)))
        except Unreadable as exc:
            bad.append(Unplannable(unit.name, f"{unit.main.name}: {exc.reason}"))
        except OSError as exc:
            bad.append(Unplannable(unit.name, f"cannot be read: {exc.strerror}"))
    return models, bad


def plan(
    engine: str,
    models: Sequence[RouterModel],
    room: int,
    load_on_startup: Sequence[str],
    opts: Options,
    *,
    multiplier: float,
    unplannable: Sequence[Unplannable] = (),
) -> RouterPlan:
    def one(model: RouterModel, space: int) -> ModelNeed:
        return plan_model(
            model.name,
            model.weights,
            model.shape,
            space,
            context=opts.context,
            parallel=opts.parallel,
            multiplier=multiplier,
            type_k=opts.type_k,
            type_v=opts.type_v,
        )

    alone = [one(model, room) for model in sorted(models, key=lambda m: m.name)]
    fitting = [need for need in alone if _fits(need, room)]
    unfit = [need for need in alone if not _fits(need, room)]
    by_name = {model.name: model for model in models}
    wanted = [by_name[name] for name in dict.fromkeys(load_on_startup) if name in by_name]
    if wanted:
        kv_room = share_room(room, [(m.weights, m.shape) for m in wanted], multiplier)
        together = []
        for model in wanted:
            cost = model.weights if model.shape.embedding else math.ceil(model.weights * multiplier)
            together.append(one(model, kv_room + cost))
        startup = EngineNeed(engine, tuple(together), ADVICE)
    else:
        largest = max(fitting, key=lambda need: need.need, default=None)
        startup = EngineNeed(engine, (largest,) if largest else (), ADVICE)
    return RouterPlan(tuple(fitting), tuple(unfit), tuple(unplannable), startup)


def _fits(need: ModelNeed, room: int) -> bool:
    return need.need <= room and (need.context > 0 or need.embedding or need.kv_per_token == 0)


def units(found: library.Library) -> list[Unit]:
    """Each Ready library model's units, from its own files (no cache): what the plan reads."""
    return [unit for model in found.models for unit in ggufcheck.group(model.files).units]


def route(
    name: str,
    recipe: LlamaRouterRecipe,
    read: tuple[Sequence[RouterModel], Sequence[Unplannable]],
    room: int,
    multiplier: float,
) -> RouterPlan:
    """The router plan of these read headers in room: each model alone, the load-on-startup
    set together. The router defaults' ValueError says what is wrong with them."""
    models, bad = read
    return plan(
        name,
        models,
        room,
        recipe.router.load_on_startup,
        options(recipe.router.defaults),
        multiplier=multiplier,
        unplannable=bad,
    )


def engine_plan(recipe: LlamaRouterRecipe, budget: Budget, multiplier: float) -> EnginePlan:
    """Every Ready model of the library from its GGUF header; the startup set planned together
    (the kind's planner: what `lucia-supervisor plan` shows)."""
    options(recipe.router.defaults)  # refused before any header is read
    read = read_models(units(library.scan(recipe.library.models_path)))
    routed = route(recipe.name, recipe, read, budget.left, multiplier)
    return EnginePlan(recipe.name, check(routed.startup, budget), router=routed)
