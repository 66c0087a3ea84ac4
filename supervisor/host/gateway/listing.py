"""GET /v1/models, pure: each model of each engine the catalog holds.

With its engine's state, its build, what it serves, the tiers that name it, its engine's
admission counts and its probe's mark. Everything here is read from status.json, the settings
and the probe; nothing is asked of an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from supervisor.host.proxy import probe
from supervisor.host.proxy.catalog import CatalogEntry


def models(
    *,
    engines: Iterable[CatalogEntry],
    aliases: Mapping[str, str],
    default_tier: str | None,
    counts: Mapping[str, tuple[int, int]],
    marks: Callable[[CatalogEntry], Mapping[str, probe.Mark]],
    now: datetime,
) -> dict[str, Any]:
    """The OpenAI list object; `counts`: engine -> (running, waiting); `marks`: an engine's
    probe marks by model."""
    tiers: dict[str, list[str]] = {}
    for tier, model in aliases.items():
        tiers.setdefault(model, []).append(tier)
    data = [
        entry(
            engine=engine,
            model=model,
            tiers=tiers.get(model, []),
            default_tier=default_tier,
            counts=counts,
            marks=marks(engine),
            now=now,
        )
        for engine in engines
        for model in engine.models
    ]
    return {"object": "list", "data": data}


def entry(
    *,
    engine: CatalogEntry,
    model: str,
    tiers: list[str],
    default_tier: str | None,
    counts: Mapping[str, tuple[int, int]],
    marks: Mapping[str, probe.Mark],
    now: datetime,
) -> dict[str, Any]:
    status = engine.status
    running = status.engine if status is not None else None
    at_once, waiting = counts.get(engine.name, (0, 0))
    mark = marks.get(model)
    return {
        "id": model,
        "object": "model",
        "created": 0,
        "owned_by": "lucia",
        "engine": engine.name,
        "state": status.state if status is not None else None,
        "fresh": engine.fresh(now),
        "tiers": sorted(tiers),
        "default": default_tier is not None and default_tier in tiers,
        # what its engine declares it serves; null while that is not known
        "capabilities": engine.capabilities(model),
        "build": {"engineVersion": running.engine_version, "image": running.image}
        if running is not None
        else None,
        "weightsRevision": running.model_revision if running is not None else None,
        "running": at_once,
        "waiting": waiting,
        "degraded": mark is not None and mark.degraded,
        "probe": mark.shown() if mark is not None else None,
    }
