"""This gateway in a fleet: its catalog, published from its engines, running with the app.

Only when `[fleet] machine` is set (the settings then hold a PostgreSQL `[record] dsn`): the
catalog (fleet/catalog.py) runs as a cleanup context of the app, publishes this machine's
engines as rows.rows_of makes them from the engine catalog and the admission counts, and
removes them at the app's shutdown, before the requests in flight end. psycopg is imported
then only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeAlias

from aiohttp import web

from supervisor.host.fleet.forward import PeerClient
from supervisor.host.fleet.peers import Peers
from supervisor.host.fleet.tls import client_context
from supervisor.host.gateway.outward import Outward
from supervisor.host.gateway.settings import GatewaySettings
from supervisor.host.proxy.bodies import Bodies
from supervisor.host.proxy.catalog import Catalog

if TYPE_CHECKING:
    from supervisor.host.fleet.rows import PeerEngine

Fleet: TypeAlias = "Outward | None"  # the Gateway's: None with [fleet] off


def join(
    app: web.Application,
    settings: GatewaySettings,
    catalog: Catalog,
    counts: Callable[[], Mapping[str, tuple[int, int]]],
    *,
    peers: Peers | None,
    bodies: Bodies,
) -> Fleet:
    """The fleet's catalog, running with `app`, and the way out to its peers (outward.py);
    None when this gateway is in no fleet."""
    fleet = settings.fleet
    if not fleet.on or settings.record.dsn is None or peers is None:
        return None
    from supervisor.host.fleet.catalog import FleetCatalog  # noqa: PLC0415 - psycopg: on only
    from supervisor.host.fleet.rows import rows_of  # noqa: PLC0415

    def rows() -> list[PeerEngine]:
        return rows_of(fleet.machine, fleet.advertise, catalog.engines(), counts(), Catalog.now())

    found = FleetCatalog(fleet, settings.record.dsn, rows)
    app.cleanup_ctx.append(found.task)
    app.on_shutdown.append(found.withdraw)
    listen = settings.listen
    tls = None
    if listen.tls_cert is not None and listen.tls_key is not None and fleet.ca_file is not None:
        tls = client_context(listen.tls_cert, listen.tls_key, fleet.ca_file)
    client = PeerClient(peers, tls)
    app.cleanup_ctx.append(client.session)
    return Outward(found, client, settings, bodies)
