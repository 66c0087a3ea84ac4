"""The llama-router's memory plan at sync: every cached model planned from its GGUF header in
the room the machine has now, the load-on-startup set planned together. What the preset gets
from it: the models offered (a model that cannot fit even alone is not), and with
`ctx-size = "auto"` each model's planned context."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from supervisor.engines.llama_router import plan as router
from supervisor.engines.llama_router.gguf_cache import CachedModel
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.errors import Blocked, Permanent
from supervisor.library.ggufcheck import Unit
from supervisor.memplan.fit import Budget, check
from supervisor.memplan.guard import Guard, room
from supervisor.memplan.need import EngineNeed, ModelNeed

AUTO_KEYS = ("ctx-size", "c")


@dataclass(frozen=True)
class LibraryPlan:
    offered: tuple[str, ...]  # the models the preset offers, sorted
    defaults: dict[str, router.DefaultValue]  # the [*] section ("auto" taken out)
    contexts: dict[str, int] | None  # per model ctx-size, when "auto"
    startup: tuple[ModelNeed, ...]  # what the router's start claims
    unfit: tuple[str, ...]  # not offered: cannot fit even alone
    unplanned: tuple[str, ...]  # offered, but their headers could not be planned


def _unit(cache_dir: Path, model: CachedModel) -> Unit:
    shards = tuple(cache_dir / f for f in model.files if f != model.mmproj_file)
    mmproj = cache_dir / model.mmproj_file if model.mmproj_file else None
    return Unit(model.name, shards, mmproj)


def plan(
    name: str,
    recipe: LlamaRouterRecipe,
    cached: Sequence[CachedModel],
    cache_dir: Path,
    guard: Guard | None,
) -> LibraryPlan:
    defaults = recipe.router.defaults
    try:
        opts = router.options(defaults)
    except ValueError as exc:
        raise Permanent(f"router defaults: {exc}") from None
    now = room(guard)
    models, bad = router.read_models([_unit(cache_dir, m) for m in cached])
    startup_names = recipe.router.load_on_startup
    routed = router.plan(
        name,
        models,
        now.budget.left,
        startup_names,
        opts,
        multiplier=now.settings.weight_multiplier,
        unplannable=bad,
    )
    for model in routed.unfit:
        if model.name in startup_names:  # refused before anything starts, with the numbers
            alone = EngineNeed(name, (model,), router.ADVICE)
            verdict = check(alone, now.budget)
            raise (Blocked if verdict.waitable else Permanent)(verdict.message)
    auto = opts.context == "auto"
    contexts = None
    if auto:
        together = {m.name: m.context for m in routed.startup.models if m.name in startup_names}
        contexts = {**routed.contexts(), **together}
    offered = sorted({m.name for m in routed.offered} | {u.name for u in routed.unplannable})
    return LibraryPlan(
        offered=tuple(offered),
        defaults={k: v for k, v in defaults.items() if not (auto and k in AUTO_KEYS)},
        contexts=contexts,
        startup=routed.startup.models,
        unfit=tuple(m.name for m in routed.unfit),
        unplanned=tuple(u.name for u in routed.unplannable),
    )


def dump(models: Sequence[ModelNeed]) -> list[dict[str, Any]]:
    return [asdict(model) for model in models]


def load(found: object) -> tuple[ModelNeed, ...]:
    """The startup models as synced.json recorded them; () for anything else."""
    if not isinstance(found, list):
        return ()
    try:
        return tuple(ModelNeed(**entry) for entry in found if isinstance(entry, Mapping))
    except TypeError:
        return ()


def need(name: str, startup: Sequence[ModelNeed]) -> EngineNeed:
    return EngineNeed(name, tuple(startup), router.ADVICE)


class Headers:
    """The library's GGUF headers as the memory plan reads them, read again only when the
    library as found changes (its fingerprint): each look at the library plans a start, and
    most looks find nothing new."""

    def __init__(self) -> None:
        self._read: tuple[str, tuple[list[router.RouterModel], list[router.Unplannable]]] | None
        self._read = None

    def models(
        self, key: str, units: Sequence[Unit]
    ) -> tuple[list[router.RouterModel], list[router.Unplannable]]:
        if self._read is None or self._read[0] != key:
            self._read = (key, router.read_models(units))
        return self._read[1]


def library_need(
    name: str,
    recipe: LlamaRouterRecipe,
    read: tuple[Sequence[router.RouterModel], Sequence[router.Unplannable]],
    budget: Budget,
    multiplier: float,
) -> EngineNeed:
    """The start the next sync would plan in this budget, from every Ready model of the library
    (as `lucia-supervisor plan` plans it, before any sync): the load-on-startup set together,
    or a load-on-startup model that cannot fit even alone, which the sync refuses."""
    routed = router.route(name, recipe, read, budget.left, multiplier)
    for model in routed.unfit:
        if model.name in recipe.router.load_on_startup:
            return EngineNeed(name, (model,), router.ADVICE)
    return routed.startup
