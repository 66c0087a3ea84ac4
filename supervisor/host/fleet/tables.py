"""The catalog's tables in PostgreSQL, and each statement the catalog runs on them.

`fleet_machines` holds one row per machine: its stored form (its gateway's URL, as JSON), its
heartbeat (`heard`, the database's clock) and a version raised by each publish.
`fleet_engines` holds one row per engine of a machine, keyed by its name as JSON
(rows.engine_key), its stored form (rows.document), removed with its machine. `fleet_schema`
holds the version applied: `migrate` creates what is missing under the record's advisory lock
(database.MIGRATION_LOCK), so gateways starting at once migrate one after the other, and
refuses tables of a newer version. A publish commits the machine's rows and its
`NOTIFY lucia_fleet, '<machine>'` together; a reader turns the database's age of each
heartbeat into a time on its own clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from supervisor.host.fleet.rows import (
    PeerEngine,
    document,
    engine_key,
    machine_document,
    read_key,
    read_row,
    read_url,
)
from supervisor.host.record.database import MIGRATION_LOCK, StoreFailed
from supervisor.protocol.documents import utc_now

if TYPE_CHECKING:
    from psycopg import AsyncConnection

CHANNEL: Final = "lucia_fleet"
MAX_ROWS: Final = 100_000  # engine rows read at once; beyond them a catalog is not believed
V1: Final = (
    """CREATE TABLE fleet_machines (
        machine TEXT PRIMARY KEY,
        doc TEXT NOT NULL,
        heard TIMESTAMPTZ NOT NULL,
        version BIGINT NOT NULL
    )""",
    """CREATE TABLE fleet_engines (
        machine TEXT NOT NULL REFERENCES fleet_machines (machine) ON DELETE CASCADE,
        engine TEXT NOT NULL,
        doc TEXT NOT NULL,
        PRIMARY KEY (machine, engine)
    )""",
)
# Version N is MIGRATIONS[N - 1]; a new version is a new entry at the end, never an edit.
MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (V1,)
VERSION: Final = len(MIGRATIONS)


class FleetSchemaTooNew(StoreFailed):
    """The catalog's tables were made by a newer version of lucia-supervisor."""


@dataclass(frozen=True)
class Known:
    """One machine as last read: its gateway's URL, its heartbeat here, its engines."""

    name: str
    url: str
    heard: datetime
    version: int
    engines: tuple[PeerEngine, ...]


async def migrate(conn: AsyncConnection[tuple[Any, ...]]) -> int:
    """Create the tables this version uses; the version they were at."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        await conn.execute("CREATE TABLE IF NOT EXISTS fleet_schema (version BIGINT NOT NULL)")
        found = await (await conn.execute("SELECT version FROM fleet_schema")).fetchall()
        before = int(found[0][0]) if found else 0
        if before > VERSION:
            raise FleetSchemaTooNew(
                f"the fleet catalog's tables are version {before}; this lucia-supervisor knows "
                f"up to {VERSION}: upgrade it"
            )
        for statements in MIGRATIONS[before:]:
            for statement in statements:
                await conn.execute(statement)
        if before == 0:
            await conn.execute("INSERT INTO fleet_schema (version) VALUES (%s)", (VERSION,))
        elif before < VERSION:
            await conn.execute("UPDATE fleet_schema SET version = %s", (VERSION,))
    return before


async def made(conn: AsyncConnection[tuple[Any, ...]]) -> bool:
    """Whether the catalog's tables are there (a reader never makes them)."""
    found = await conn.execute("SELECT to_regclass('fleet_engines') IS NOT NULL")
    return bool((await found.fetchall())[0][0])


async def publish(
    conn: AsyncConnection[tuple[Any, ...]],
    machine: str,
    url: str,
    changed: Sequence[PeerEngine],
    keep: Iterable[str],
) -> None:
    """One transaction: the machine's heartbeat and version, its `changed` rows written, every
    other row of it not named in `keep` removed, and the NOTIFY its readers wait for."""
    async with conn.transaction():
        await conn.execute(
            "INSERT INTO fleet_machines (machine, doc, heard, version) "
            "VALUES (%s, %s, clock_timestamp(), 1) ON CONFLICT (machine) DO UPDATE SET "
            "doc = EXCLUDED.doc, heard = EXCLUDED.heard, version = fleet_machines.version + 1",
            (machine, machine_document(url)),
        )
        await conn.execute(
            "DELETE FROM fleet_engines WHERE machine = %s AND NOT (engine = ANY(%s))",
            (machine, sorted(engine_key(name) for name in keep)),
        )
        if changed:
            async with conn.cursor() as cursor:
                await cursor.executemany(
                    "INSERT INTO fleet_engines (machine, engine, doc) VALUES (%s, %s, %s) "
                    "ON CONFLICT (machine, engine) DO UPDATE SET doc = EXCLUDED.doc",
                    [(machine, engine_key(row.engine), document(row)) for row in changed],
                )
        await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, machine))


async def beat(conn: AsyncConnection[tuple[Any, ...]], machine: str) -> bool:
    """The machine's heartbeat; False when it has no row (removed since: publish it again)."""
    done = await conn.execute(
        "UPDATE fleet_machines SET heard = clock_timestamp() WHERE machine = %s", (machine,)
    )
    return done.rowcount == 1


async def withdraw(conn: AsyncConnection[tuple[Any, ...]], machine: str) -> None:
    """The machine's rows removed, and its readers told."""
    async with conn.transaction():
        await conn.execute("DELETE FROM fleet_machines WHERE machine = %s", (machine,))
        await conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, machine))


async def read(
    conn: AsyncConnection[tuple[Any, ...]], machines: Sequence[str] | None
) -> dict[str, Known]:
    """Every machine (`machines` None), or those named, with their engines. A machine whose
    URL, or an engine whose row, is not in the form written here is left out."""
    cursor = await conn.execute(
        "SELECT m.machine, m.doc, m.version, "
        "EXTRACT(EPOCH FROM clock_timestamp() - m.heard)::float8, e.engine, e.doc "
        "FROM fleet_machines m LEFT JOIN fleet_engines e ON e.machine = m.machine "
        "WHERE %s::text[] IS NULL OR m.machine = ANY(%s::text[]) "
        "ORDER BY m.machine, e.engine LIMIT %s",
        (None if machines is None else list(machines),) * 2 + (MAX_ROWS,),
    )
    found = await cursor.fetchall()
    return gather(found, utc_now())  # the ages are the database's as it answered


def gather(found: Iterable[Sequence[Any]], now: datetime) -> dict[str, Known]:
    """Pure: the query's lines as machines; each heartbeat placed on this machine's clock."""
    machines: dict[str, tuple[str, datetime, int]] = {}
    engines: dict[str, list[PeerEngine]] = {}
    for name, machine_doc, version, age_s, engine, engine_doc in found:
        if name not in machines:
            url = read_url(machine_doc)
            if url is None:
                continue
            machines[name] = (url, now - timedelta(seconds=float(age_s)), int(version))
            engines[name] = []
        if engine is None:  # a machine with no engine: the join's one line for it
            continue
        url, heard, _ = machines[name]
        key = read_key(engine)
        row = read_row(name, key, url, engine_doc, heard) if key is not None else None
        if row is not None:
            engines[name].append(row)
    return {
        name: Known(name, url, heard, version, tuple(engines[name]))
        for name, (url, heard, version) in machines.items()
    }
