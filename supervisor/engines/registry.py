"""The engine registry: the known engine kinds, and the engine for a recipe by its `engine`.

The shipped kinds are listed here by module path; LUCIA_ENGINE_MODULES (comma-separated module
paths) adds more, e.g. an engine that lives outside this package. Each module holds one
EngineKind as `KIND`. Modules are imported when the registry is first asked, so that knowing the
kinds' names costs no engine (and no Docker) import for code that never makes one.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

from supervisor.engines.kind import EngineKind

if TYPE_CHECKING:
    from supervisor.docker.runtime import Runtime
    from supervisor.engines.base import Engine
    from supervisor.memplan.fit import Budget
    from supervisor.memplan.overview import EnginePlan
    from supervisor.recipe.schema import RecipeBase

MODULES_ENV: Final = "LUCIA_ENGINE_MODULES"
SHIPPED: Final = (
    "supervisor.engines.tensorfold.kind",
    "supervisor.engines.llama_router.kind",
    "supervisor.engines.vllm.kind",
)


class RegistryError(ValueError):
    """An engine module that cannot be registered; str() says which and why."""


class UnknownEngine(LookupError):
    """A recipe names an engine kind nobody registered; str() names the known ones."""

    def __init__(self, name: str, known: tuple[str, ...]) -> None:
        super().__init__(f"{name!r} is not a known engine; known: {', '.join(known)}")
        self.name = name
        self.known = known


def configured() -> tuple[str, ...]:
    """The engine modules: the shipped ones, then LUCIA_ENGINE_MODULES'."""
    extra = os.environ.get(MODULES_ENV, "")
    return SHIPPED + tuple(part.strip() for part in extra.split(",") if part.strip())


def kinds(modules: tuple[str, ...] | None = None) -> Mapping[str, EngineKind]:
    """The registered kinds by name (modules: the configured ones unless given)."""
    return _load(configured() if modules is None else modules)


@functools.cache
def _load(modules: tuple[str, ...]) -> Mapping[str, EngineKind]:
    found: dict[str, EngineKind] = {}
    for path in dict.fromkeys(modules):
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise RegistryError(f"engine module {path}: cannot be imported: {exc}") from None
        kind = getattr(module, "KIND", None)
        if not isinstance(kind, EngineKind):
            raise RegistryError(f"engine module {path}: has no KIND (an EngineKind)")
        if kind.name in found:
            raise RegistryError(f"engine module {path}: the kind {kind.name!r} is registered twice")
        found[kind.name] = kind
    return found


def names() -> tuple[str, ...]:
    return tuple(kinds())


def get(name: str) -> EngineKind:
    """The kind for `engine = name`; raises UnknownEngine (naming the known ones)."""
    known = kinds()
    if name not in known:
        raise UnknownEngine(name, tuple(known))
    return known[name]


def create(
    name: str, recipe: RecipeBase, runtime: Runtime, state_dir: Path, data_dir: Path | None = None
) -> Engine:
    """The engine of the recipe's kind, its class imported now (each kind's engine takes
    these same arguments). data_dir: where the machine's memory claims are shared; None plans
    no memory."""
    path = get(recipe.engine).engine
    module, _, cls = path.partition(":")
    try:
        made = getattr(importlib.import_module(module), cls)
    except (ImportError, AttributeError) as exc:
        raise RegistryError(f"engine class {path}: cannot be imported: {exc}") from None
    engine: Engine = made(name, recipe, runtime, state_dir, data_dir)
    return engine


def plan_memory(recipe: RecipeBase, budget: Budget, multiplier: float) -> EnginePlan:
    """The recipe's plan by its kind's memory planner: the planner `overview.build` is given."""
    return get(recipe.engine).memory(recipe, budget, multiplier)
