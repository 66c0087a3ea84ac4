"""The page in a fleet: every other machine's engines, and Start and Stop sent to its gateway.

The overview's `fleet` (None with [fleet] off) lists each other machine of the fleet's catalog
by name: whether it is stale and how long since it was heard, and each engine's state, models,
running and waiting, as that machine published them (page.js shows all of it as text: another
machine's names are anyone's text). A Start or Stop of another machine's engine is the page's
own request (its session, CSRF token and origin rules, routes.Page's guard), which this gateway
sends on to that machine's gateway through the fleet's owner API (fleet/owner.py). A machine
the catalog does not know, one gone stale, or a catalog that is unavailable: a clear refusal,
and nothing is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, Protocol

from aiohttp import web

from supervisor.host.fleet import owner
from supervisor.host.fleet.forward import PeerClient
from supervisor.host.fleet.rows import Machine, PeerEngine
from supervisor.host.proxy.catalog import Catalog
from supervisor.host.proxy.hostapi import too_large, wanted
from supervisor.host.web.intake import read_body
from supervisor.host.web.refusal import Refusal

if TYPE_CHECKING:  # made only in a fleet: psycopg is imported then only
    from supervisor.host.fleet.catalog import FleetCatalog

PATH: Final = "/api/machines/{machine}/engines/{name}"
_BODY_LIMIT: Final = 1024
_BODY_TIMEOUT_S: Final = 10.0


class Fleet(Protocol):
    """What the page reads of the gateway's fleet (gateway.outward.Outward)."""

    @property
    def catalog(self) -> FleetCatalog: ...

    @property
    def client(self) -> PeerClient: ...


def engine_row(row: PeerEngine) -> dict[str, Any]:
    """Pure: one engine of another machine, as the page shows it."""
    return {
        "name": row.engine,
        "state": row.state,
        "models": list(row.models),
        "running": row.running,
        "waiting": row.waiting,
        "slots": row.slots,
        "build": row.build,
        "weights": row.weights,
        "fits": row.fits,
        "plan": row.plan,
        "stoppedByOperator": row.stopped_by_operator,
    }


def shown(machines: list[Machine], own: str, now: datetime) -> list[dict[str, Any]]:
    """Pure: every machine but this one, by name, as the page shows it."""
    return [
        {
            "name": machine.name,
            "stale": machine.stale,
            "heardAge": max(0.0, (now - machine.heard).total_seconds()),
            "engines": [engine_row(row) for row in machine.engines],
        }
        for machine in machines
        if machine.name != own
    ]


def target(machines: list[Machine], own: str, name: str, available: bool) -> Machine:
    """Pure: the machine a Start or Stop goes to; else why not (409, 404 or 503)."""
    if name == own:
        raise Refusal(409, "invalid_request", f"machine {own} is this one: use its own engines")
    if not available:
        raise Refusal(
            503,
            "fleet_unavailable",
            "the fleet's catalog is not available (its PostgreSQL does not answer): no other "
            "machine is asked until it is back",
        )
    found = next((machine for machine in machines if machine.name == name), None)
    if found is None:
        known = ", ".join(m.name for m in machines if m.name != own) or "none"
        raise Refusal(404, "machine_not_found", f"no machine {name} in the fleet. Others: {known}")
    if found.stale:
        raise Refusal(
            503,
            "machine_stale",
            f"machine {name} is stale (last heard at {found.heard.isoformat(timespec='seconds')}"
            "): its gateway is not asked until it is heard again",
            machine=name,
        )
    return found


class Machines:
    """The page's side of the fleet: None from `fleet()` with [fleet] off."""

    def __init__(self, fleet: Callable[[], Fleet | None]) -> None:
        self.fleet = fleet

    def overview(self) -> dict[str, Any] | None:
        fleet = self.fleet()
        if fleet is None:
            return None
        catalog, now = fleet.catalog, Catalog.now()
        machines = catalog.machines(now)
        return {
            "machine": catalog.machine,
            "available": bool(machines),
            "staleS": catalog.stale_s,
            "machines": shown(machines, catalog.machine, now),
        }

    async def set_desired(self, request: web.Request) -> web.Response:
        """`POST /page/api/machines/M/engines/N` `{"desired": ...}`: sent to machine M."""
        fleet = self.fleet()
        if fleet is None:
            raise Refusal(404, "not_found", "this gateway is in no fleet ([fleet] machine)")
        raw = await read_body(request, _BODY_LIMIT, _BODY_TIMEOUT_S, too_large)
        desired = wanted(raw)
        catalog, name = fleet.catalog, request.match_info["machine"]
        machines = catalog.machines(Catalog.now())
        found = target(machines, catalog.machine, name, bool(machines))
        engine = request.match_info["name"]
        answer = await owner.ask(
            fleet.client, found.name, found.url, engine, desired, timeout_s=owner.ASK_S
        )
        return web.json_response(answer, status=202)
