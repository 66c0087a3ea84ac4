"""The host API, for the owner only: each engine's status, and a request to run or stop it.

It reports whether each heartbeat is fresh, and writes requests through the protocol's host
module.

An engine the owner asks for is the operator's from then on: idle stop leaves it alone, and
one the owner stopped is not started on demand (the request says `requestedBy: operator`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from supervisor.host.protocol import request
from supervisor.host.proxy import body
from supervisor.host.proxy.admission import Gate
from supervisor.host.proxy.catalog import Catalog, CatalogEntry
from supervisor.host.proxy.idle import IdleStop
from supervisor.host.web.intake import read_body
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import dump
from supervisor.protocol.layout import BadName, check_name, engine_dir
from supervisor.protocol.reads import read_desired

ENGINES: Final = "/api/host/engines"
_BODY_LIMIT: Final = 64 * 1024
_DESIRED: Final = ("running", "stopped")


def too_large() -> Refusal:
    return Refusal(413, "request_too_large", "the body of the host API is limited to 64 KiB")


def wanted(raw: bytes) -> str:
    """Pure: the state a POST asks for; 400 naming what is wrong."""
    document = body.decode(raw)
    desired = document.get("desired")
    if desired not in _DESIRED or set(document) != {"desired"}:
        raise Refusal(
            400,
            "invalid_request",
            'the body must be {"desired": "running"} or {"desired": "stopped"}',
            param="desired",
        )
    return str(desired)


class HostApi:
    def __init__(
        self,
        data_dir: Path,
        catalog: Catalog,
        gates: Callable[[str], Gate | None],
        idle: IdleStop,
        body_timeout_s: float,
        *,
        bound: Callable[[CatalogEntry], int],
        probed: Callable[[CatalogEntry], dict[str, Any]] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.body_timeout_s = body_timeout_s
        self.catalog = catalog
        self.gates = gates
        self.idle = idle
        self.bound = bound
        self.probed = probed

    def routes(self, app: web.Application) -> None:
        app.router.add_get(ENGINES, self.engines)
        app.router.add_post(ENGINES + "/{name}", self.set_desired)

    async def engines(self, _: web.Request) -> web.Response:
        now = Catalog.now()
        rows = [self.row(engine, now) for engine in self.catalog.engines()]
        return web.json_response({"engines": rows})

    def row(self, engine: CatalogEntry, now: Any) -> dict[str, Any]:
        desired = read_desired(engine_dir(self.data_dir, engine.name))
        gate = self.gates(engine.name)
        return {
            "name": engine.name,
            "fresh": engine.fresh(now),
            "status": json.loads(dump(engine.status)) if engine.status is not None else None,
            "desired": json.loads(dump(desired)) if desired is not None else None,
            "startedByGateway": engine.name in self.idle.starter.started,
            "running": gate.running if gate is not None else 0,
            "waiting": gate.waiting if gate is not None else 0,
            "bound": self.bound(engine),  # how many it gets at once, by its status now
            # what the gateway's probe says of it: `degraded`, and each probed model's mark
            "probe": self.probed(engine) if self.probed is not None else None,
        }

    async def set_desired(self, request: web.Request) -> web.Response:
        raw = await read_body(request, _BODY_LIMIT, self.body_timeout_s, too_large)
        answer = await self.apply(request.match_info["name"], wanted(raw), "operator")
        return web.json_response(answer, status=202)

    async def apply(self, name: str, desired: str, by: str) -> dict[str, Any]:
        """Ask for engine `name` in state `desired`, as `by` (an operator: `operator`, or
        `operator@<machine>` through another machine of a fleet); 400 or 404 naming why."""
        try:
            check_name(name)
        except BadName as exc:
            raise Refusal(400, "invalid_request", str(exc), param="name") from None
        known = [engine.name for engine in self.catalog.engines()]
        if name not in known:
            raise Refusal(
                404,
                "engine_not_found",
                f"no engine {name} has a worker here. Engines: {', '.join(known) or 'none'}",
            )
        generation = await asyncio.to_thread(request_state, self.data_dir, name, desired, by)
        self.idle.starter.started.pop(name, None)  # the operator's from now on
        self.idle.stopping.discard(name)
        return {"engine": name, "desired": desired, "generation": generation}


def request_state(data_dir: Path, name: str, desired: str, by: str = "operator") -> int:
    return request(data_dir, name, "running" if desired == "running" else "stopped", by)
