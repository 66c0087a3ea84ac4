"""The record's schema, versioned: an ordered list of migrations, the same SQL on both databases.

`schema_version` holds one row, the version applied. `migrate` applies what is missing in one
transaction (exclusive on SQLite, under an advisory lock on PostgreSQL) and refuses a database
whose version is newer than this code knows: an older gateway never writes into a schema it
does not understand.

The types are those both databases read alike: BIGINT (SQLite's INTEGER affinity), DOUBLE
PRECISION (SQLite's REAL), TEXT. A time is microseconds since the epoch, UTC; a day is its UTC
date as `YYYY-MM-DD`, which sorts as it counts.
"""

from __future__ import annotations

from typing import Final

from supervisor.host.record.database import Database, StoreFailed

V1: Final = (
    """CREATE TABLE generations (
        at_us BIGINT NOT NULL,
        key_id TEXT NOT NULL,
        model TEXT NOT NULL,
        engine TEXT NOT NULL,
        engine_version TEXT NOT NULL,
        image_id TEXT NOT NULL,
        weights_revision TEXT NOT NULL,
        outcome TEXT NOT NULL,
        prompt_tokens BIGINT,
        completion_tokens BIGINT,
        cached_tokens BIGINT,
        wait_s DOUBLE PRECISION NOT NULL,
        ttft_s DOUBLE PRECISION,
        duration_s DOUBLE PRECISION NOT NULL
    )""",
    "CREATE INDEX generations_at ON generations (at_us)",
    """CREATE TABLE daily_totals (
        day TEXT NOT NULL,
        key_id TEXT NOT NULL,
        tokens BIGINT NOT NULL,
        requests BIGINT NOT NULL,
        PRIMARY KEY (day, key_id)
    )""",
)

# where a row's token counts came from (row.USAGE_SOURCES); NULL in a row written before it
V2: Final = ("ALTER TABLE generations ADD COLUMN usage_source TEXT",)

# the fleet's machine whose gateway served the row ([fleet] machine); NULL in a row written
# before it, and by a gateway in no fleet
V3: Final = ("ALTER TABLE generations ADD COLUMN machine TEXT",)

# Version N is MIGRATIONS[N - 1]; a new version is a new entry at the end, never an edit.
MIGRATIONS: Final[tuple[tuple[str, ...], ...]] = (V1, V2, V3)
VERSION: Final = len(MIGRATIONS)


class SchemaTooNew(StoreFailed):
    """The database was migrated by a newer version of lucia-supervisor."""


def current(db: Database) -> int:
    """The version applied; 0 for a database with no schema_version table."""
    db.execute("CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)")
    found = db.query("SELECT version FROM schema_version")
    return int(found[0][0]) if found else 0


def migrate(db: Database) -> int:
    """Bring the schema to VERSION; the version it was at. SchemaTooNew if it is ahead."""
    with db.transaction(migration=True):
        before = current(db)
        if before > VERSION:
            raise SchemaTooNew(
                f"the record's schema is version {before}; this lucia-supervisor knows up to "
                f"{VERSION}: upgrade it (or point it at another record)"
            )
        for statements in MIGRATIONS[before:]:
            for statement in statements:
                db.execute(statement)
        if before == 0:
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (VERSION,))
        elif before < VERSION:
            db.execute("UPDATE schema_version SET version = ?", (VERSION,))
    return before


def check(db: Database) -> None:
    """For a reader (the usage command): the schema is one this code reads; else StoreFailed."""
    found = db.query("SELECT version FROM schema_version") if _has_version(db) else []
    version = int(found[0][0]) if found else 0
    if version == 0:
        raise StoreFailed("no record has been written here yet")
    if version > VERSION:
        raise SchemaTooNew(
            f"the record's schema is version {version}; this lucia-supervisor reads up to {VERSION}"
        )


def _has_version(db: Database) -> bool:
    if db.kind == "sqlite":
        sql = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    else:
        sql = (
            "SELECT 1 FROM information_schema.tables "
            "WHERE table_schema = current_schema() AND table_name = 'schema_version'"
        )
    return bool(db.query(sql))
