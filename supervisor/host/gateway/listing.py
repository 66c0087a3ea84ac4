"""GET /v1/models, pure: each model of each engine here, and of the fleet's other machines.

In a fleet, the other machines' engines are listed as their gateways published them
(fleet/catalog.py).

With its engine's state, its build, what it serves, the tiers that name it, its engine's
admission counts and its probe's mark; in a fleet, the machine it runs on, and for another
machine's engine whether that machine was heard from within [fleet] stale_s (`fresh`).
Everything here is read from status.json, the settings, the probe and the fleet's catalog;
nothing is asked of an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

from supervisor.host.fleet.rows import PeerEngine
from supervisor.host.proxy import probe
from supervisor.host.proxy.catalog import CatalogEntry


def fleet_entries(
    peers: Iterable[PeerEngine], tiers: Mapping[str, list[str]], now: datetime, stale_s: float
) -> list[dict[str, Any]]:
    """Pure: each model of each other machine's engine, as /v1/models lists a local one."""
    listed = []
    for peer in peers:
        version, _, image = (peer.build or "").partition("@")
        for model in peer.models:
            listed.append(
                {
                    "id": model,
                    "object": "model",
                    "created": 0,
                    "owned_by": "lucia",
                    "machine": peer.machine,
                    "engine": peer.engine,
                    "state": peer.state,
                    "fresh": peer.fresh(now, stale_s),
                    "tiers": sorted(tiers.get(model, [])),
                    "default": False,
                    "capabilities": peer.capabilities(model),
                    "build": {"engineVersion": version, "image": image} if peer.build else None,
                    "weightsRevision": peer.weights,
                    "running": peer.running,
                    "waiting": peer.waiting,
                    "degraded": None,  # its own gateway's probe: not published
                    "probe": None,
                }
            )
    return listed


def models(
    *,
    engines: Iterable[CatalogEntry],
    aliases: Mapping[str, str],
    default_tier: str | None,
    counts: Mapping[str, tuple[int, int]],
    marks: Callable[[CatalogEntry], Mapping[str, probe.Mark]],
    now: datetime,
    machine: str | None = None,
    peers: Iterable[PeerEngine] = (),
    stale_s: float = 0,
) -> dict[str, Any]:
    """The OpenAI list object; `counts`: engine -> (running, waiting); `marks`: an engine's
    probe marks by model; in a fleet, this `machine`'s name and the other machines' engines
    (`peers`, fresh within `stale_s`)."""
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
    if machine is not None:  # a fleet's: where each model runs
        data = [{**item, "machine": machine} for item in data]
        data += fleet_entries(peers, tiers, now, stale_s)
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
