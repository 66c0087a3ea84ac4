"""`GET /healthz`: whether this gateway serves, for a load balancer's health check (HAProxy).

Open (no key: a balancer has none) and cheap: no disk, no database, no engine, one answer made
once. 200 `{"status": "ok", "machine": "<[fleet] machine, or null>"}` while the gateway serves;
503 `{"status": "stopping"}` from the moment its stop begins: `stop()`, which the service calls
at SIGTERM before its `[listen] drain_s` (the gateway still listens and serves meanwhile, so the
balancer's checks see the 503 and send it nothing new), and the app's on_shutdown, which comes
after the listening socket is closed (a check then fails to connect, which marks it down too).
"""

from __future__ import annotations

import json
from typing import Final

from aiohttp import web

from supervisor.host.web.auth import HEALTH_PATH

_JSON: Final = "application/json"
_FRESH: Final = {"Cache-Control": "no-store"}


class Health:
    """The one answer of /healthz: ok until the gateway's stop begins, then stopping."""

    def __init__(self, machine: str) -> None:
        self._ok = json.dumps({"status": "ok", "machine": machine or None}).encode()
        self._stopping = json.dumps({"status": "stopping"}).encode()
        self.stopping = False

    def stop(self) -> None:
        self.stopping = True

    async def shutting_down(self, _: web.Application) -> None:
        self.stop()

    async def serve(self, _: web.Request) -> web.Response:
        body, status = (self._stopping, 503) if self.stopping else (self._ok, 200)
        return web.Response(body=body, status=status, content_type=_JSON, headers=_FRESH)


HEALTH: Final = web.AppKey("health", Health)


def routes(app: web.Application, machine: str) -> Health:
    """`/healthz` on the app, and its turn to 503 when the app shuts down."""
    health = app[HEALTH] = Health(machine)
    app.router.add_get(HEALTH_PATH, health.serve)
    app.on_shutdown.append(health.shutting_down)
    return health
