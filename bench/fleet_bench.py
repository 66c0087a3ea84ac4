"""Fleet catalog benchmark: `.venv/bin/python -m bench.fleet_bench [--machines N] [--engines N]`.

What the fleet's catalog costs PostgreSQL: writes a second for `--machines` gateways (3) of
`--engines` engines each (10), at the settings' defaults (stale_s 10, publish_s 1), idle (no
engine changes: heartbeats only) and while every engine's admission counts change every
0.1 s (each machine then publishes at most once a publish_s, as many rows as changed). The
catalogs are FleetCatalog instances of one process, each with its own two connections, as each
gateway has. Over `--windows` windows of `--window` seconds each (after a settling window),
taken as medians:
- the catalogs' own counts: publishes and heartbeats a second (each one write transaction),
  reads a second (each one SELECT), and notifications received;
- PostgreSQL's: committed transactions a second in the database (pg_stat_database
  xact_commit: the writes, the reads and the bench's own two statistics queries a window),
  rows written a second in the catalog's tables (pg_stat_user_tables n_tup_ins + n_tup_upd +
  n_tup_del), and WAL bytes a second (pg_current_wal_lsn).
PostgreSQL's statistics reach its views up to a second late (a backend flushes them at most
every second, and an idle one after some seconds), so a window is long against that. PostgreSQL
is a cluster of the bench's own (tests/postgres.py: initdb in a temp directory, 127.0.0.1).
Prints tables; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.standalone import machine, table  # noqa: E402
from supervisor import logs  # noqa: E402
from supervisor.host.fleet.catalog import FleetCatalog  # noqa: E402
from supervisor.host.fleet.rows import PeerEngine  # noqa: E402
from supervisor.host.gateway.sections import FleetSettings  # noqa: E402
from supervisor.protocol.documents import utc_now  # noqa: E402

CHURN_S = 0.1  # how often every engine's counts change while "changing"


@dataclass
class Counters:
    publishes: int
    beats: int
    reads: int
    notified: int
    commits: int
    rows: int
    wal: int
    at: float


class Fleet:
    """N machines' catalogs of E engines each; `churn` changes every engine's counts."""

    def __init__(self, dsn: str, machines: int, engines: int) -> None:
        self.tick = 0
        self.catalogs = [
            FleetCatalog(
                FleetSettings(machine=f"m{n}", advertise=f"http://m{n}.example:8400"),
                dsn,
                self.rows_of(f"m{n}", engines),
            )
            for n in range(machines)
        ]

    def rows_of(self, name: str, engines: int) -> Callable[[], list[PeerEngine]]:
        def rows() -> list[PeerEngine]:
            return [
                PeerEngine(
                    machine=name,
                    engine=f"engine-{e:02d}",
                    url=f"http://{name}.example:8400",
                    models=(f"model-{e:02d}", f"model-{e:02d}-instruct"),
                    state="running",
                    heard=utc_now(),
                    declared={f"model-{e:02d}": ("chat", "completion")},
                    build="b4567@0123456789ab",
                    weights="e5a1f00d",
                    running=(self.tick + e) % 5,
                    waiting=(self.tick * 7 + e) % 3,
                    slots=4,
                    fits=True,
                )
                for e in range(engines)
            ]

        return rows


async def counters(conn: psycopg.AsyncConnection[Any], fleet: Fleet) -> Counters:
    found = await conn.execute(
        "SELECT xact_commit, pg_current_wal_lsn() - '0/0'::pg_lsn FROM pg_stat_database "
        "WHERE datname = current_database()"
    )
    commits, wal = (await found.fetchall())[0]
    found = await conn.execute(
        "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0) FROM pg_stat_user_tables "
        "WHERE relname LIKE 'fleet_%'"
    )
    rows = (await found.fetchall())[0][0]
    cats = fleet.catalogs
    return Counters(
        publishes=sum(c.publishes for c in cats),
        beats=sum(c.beats for c in cats),
        reads=sum(c.reads for c in cats),
        notified=sum(c.notified for c in cats),
        commits=int(commits),
        rows=int(rows),
        wal=int(wal),
        at=time.monotonic(),
    )


def rates(before: Counters, after: Counters) -> dict[str, float]:
    span = after.at - before.at
    return {
        name: (getattr(after, name) - getattr(before, name)) / span
        for name in ("publishes", "beats", "reads", "notified", "commits", "rows", "wal")
    }


async def phase(
    dsn: str, fleet: Fleet, window: float, windows: int, churn: bool
) -> list[dict[str, float]]:
    async def change() -> None:
        while True:
            await asyncio.sleep(CHURN_S)
            fleet.tick += 1

    changing = asyncio.create_task(change()) if churn else None
    measured = []
    try:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await asyncio.sleep(window)  # settling: the statistics of what came before flushed
            last = await counters(conn, fleet)
            for _ in range(windows):
                await asyncio.sleep(window)
                now = await counters(conn, fleet)
                measured.append(rates(last, now))
                last = now
    finally:
        if changing is not None:
            changing.cancel()
    return measured


async def run(dsn: str, machines: int, engines: int, window: float, windows: int) -> None:
    fleet = Fleet(dsn, machines, engines)
    async with AsyncExitStack() as running:
        for catalog in fleet.catalogs:
            await running.enter_async_context(catalog.running())
        while not all(catalog.available and catalog.publishes for catalog in fleet.catalogs):
            await asyncio.sleep(0.05)
        results = {
            "idle": await phase(dsn, fleet, window, windows, churn=False),
            "changing": await phase(dsn, fleet, window, windows, churn=True),
        }
    lines: list[tuple[str, ...]] = []
    for name, measured in results.items():

        def median(key: str, m: list[dict[str, float]] = measured) -> float:
            return statistics.median(window_[key] for window_ in m)

        spread = [w["publishes"] + w["beats"] for w in measured]
        lines.append(
            (
                name,
                f"{median('publishes') + median('beats'):.2f}",
                f"{min(spread):.2f}-{max(spread):.2f}",
                f"{median('publishes'):.2f}",
                f"{median('beats'):.2f}",
                f"{median('reads'):.2f}",
                f"{median('notified'):.2f}",
                f"{median('commits'):.2f}",
                f"{median('rows'):.1f}",
                f"{median('wal') / 1024:.1f}",
            )
        )
    print(
        f"{machines} machines of {engines} engines, stale_s 10, publish_s 1; engines' counts "
        f"changed every {CHURN_S:g} s while changing; {windows} windows of {window:g} s, medians"
    )
    table(
        lines,
        (
            "phase",
            "writes/s",
            "range",
            "publishes/s",
            "beats/s",
            "reads/s",
            "notified/s",
            "pg commits/s",
            "pg rows/s",
            "WAL KiB/s",
        ),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--machines", type=int, default=3)
    parser.add_argument("--engines", type=int, default=10)
    parser.add_argument("--window", type=float, default=30.0, help="seconds a window")
    parser.add_argument("--windows", type=int, default=5)
    args = parser.parse_args()
    logs.configure(stream=sys.stderr)
    from tests.postgres import cluster

    print(machine())
    print()
    with cluster() as pg:
        asyncio.run(run(pg.database(), args.machines, args.engines, args.window, args.windows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
