"""A request for a model this machine does not serve, sent to the machine of the fleet that does.

Only in a fleet ([fleet] on): the fleet's catalog (fleet/catalog.py) says which machines serve
what, fleet/choose.py picks one, and the client's own body (body.as_sent: the model named as
the peer knows it) goes to that machine's gateway by fleet/forward.py, with this machine's peer
key and the verified caller's key id. The serving gateway admits, starts on demand, applies its
deadline and records the one row, naming itself: this gateway records nothing of it. A model
any engine here serves is never sent elsewhere; a request that came from a peer (door.PEER_OF)
is never sent on; with the catalog unavailable (PostgreSQL gone) nothing is sent and the
request is routed here as with no fleet.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import TYPE_CHECKING

from aiohttp import web

from supervisor.host.fleet.choose import choose
from supervisor.host.fleet.door import PEER_OF
from supervisor.host.fleet.forward import Peer, PeerClient
from supervisor.host.fleet.rows import PeerEngine
from supervisor.host.gateway import spans
from supervisor.host.gateway.settings import GatewaySettings
from supervisor.host.proxy.bodies import Bodies
from supervisor.host.proxy.body import Prepared
from supervisor.host.proxy.catalog import Catalog, CatalogEntry
from supervisor.host.web.auth import Caller

if TYPE_CHECKING:  # made only in a fleet: psycopg is imported then only
    from supervisor.host.fleet.catalog import FleetCatalog


def elsewhere(
    asked: str,
    path: str,
    engines: list[CatalogEntry],
    tiers: dict[str, str],
    peers: list[PeerEngine],
    *,
    now: datetime,
    stale_s: float,
) -> tuple[PeerEngine, str] | None:
    """Pure: the peer's engine a request goes to and the model it knows, or None: an engine
    here serves the model, or no machine of the fleet is known (the local route answers then).
    choose's refusals: 503 model_not_loaded naming the machines whose rows went stale, 404,
    400 capability_not_served."""
    model = tiers.get(asked, asked)
    if any(model in engine.models for engine in engines) or not peers:
        return None
    known = sorted({m for engine in engines for m in engine.models} | set(tiers))
    return choose(model, path, peers, now, stale_s, known=known), model


@dataclass(frozen=True)
class Outward:
    """This gateway's way out to the fleet: its catalog and its client of the peers."""

    catalog: FleetCatalog
    client: PeerClient
    settings: GatewaySettings
    bodies: Bodies

    def deadline_s(self, model: str) -> float:
        """How long a peer's answer may take in all: its wait for a place, a start, and its
        own deadline (this machine's settings for them, as the fleet's are alike)."""
        limits = self.settings.admission(model)
        return limits.max_wait_s + self.settings.limits.load_wait_s + limits.deadline_s

    async def send(
        self, request: web.Request, prepared: Prepared, engines: list[CatalogEntry], caller: Caller
    ) -> web.StreamResponse | None:
        """The peer's answer, passed on; None when the request is this machine's to serve."""
        if PEER_OF in request:
            return None
        now = Catalog.now()
        chosen = elsewhere(
            prepared.model,
            request.path,
            engines,
            self.settings.aliases,
            self.catalog.peers(now),
            now=now,
            stale_s=self.settings.fleet.stale_s,
        )
        if chosen is None:
            return None
        engine, model = chosen
        return await self.client.send(
            request,
            await self.bodies.as_sent(prepared, model),
            peer=Peer(engine.machine, engine.url),
            caller=caller,
            deadline_s=self.deadline_s(model),
            context=spans.passed_on(request.headers),
            gone=partial(self.silent, engine.machine),
            check_s=self.settings.fleet.stale_s / 4,
        )

    def silent(self, machine: str) -> bool:
        """Whether the catalog holds `machine` and has not heard from it within stale_s. A
        machine that left it (a clean stop: its answers in flight go on), or a catalog that
        is unavailable (nothing is known then), is not."""
        now = Catalog.now()
        rows = [peer for peer in self.catalog.peers(now) if peer.machine == machine]
        return bool(rows) and not any(row.fresh(now, self.settings.fleet.stale_s) for row in rows)
