"""A gateway's fleet catalog in a process of its own, for a test to SIGKILL.

    python -m tests.fleet_child DSN MACHINE STALE_S

It publishes one engine, `e`, serving `qwen`, and prints `joined` once the catalog is
available; then it runs until killed. Logs go to stderr.
"""

from __future__ import annotations

import asyncio
import sys

from supervisor import logs
from supervisor.host.fleet.catalog import FleetCatalog
from supervisor.host.fleet.rows import PeerEngine
from supervisor.host.gateway.sections import FleetSettings
from supervisor.protocol.documents import utc_now


async def main(dsn: str, machine: str, stale_s: float) -> None:
    settings = FleetSettings(
        machine=machine, advertise=f"http://{machine}.example:8400", stale_s=stale_s
    )

    def rows() -> list[PeerEngine]:
        return [
            PeerEngine(
                machine=machine,
                engine="e",
                url=settings.advertise,
                models=("qwen",),
                state="running",
                heard=utc_now(),
                slots=4,
            )
        ]

    catalog = FleetCatalog(settings, dsn, rows)
    async with catalog.running():
        while not (catalog.available and catalog.publishes):
            await asyncio.sleep(0.02)
        print("joined", flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    logs.configure(stream=sys.stderr)
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
