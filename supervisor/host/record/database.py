"""The two databases behind one small interface: SQLite in a file, or PostgreSQL by a DSN.

The SQL is written once, with `?` placeholders, and runs on both (PostgreSQL's driver takes
`%s`: the only rewrite). A write transaction is exclusive from its start on SQLite (`BEGIN
IMMEDIATE`: no upgrade from a reader that could fail half-way), and a migration on PostgreSQL
also takes a transaction-scoped advisory lock, so two gateways starting at once migrate one
after the other.

SQLite: WAL, `synchronous=FULL` (a commit is on the disk when it returns), the file and its
`-wal` and `-shm` companions mode 0600 in a 0700 directory. PostgreSQL: psycopg 3, autocommit
with explicit transactions; a connection that cannot be made within CONNECT_S fails, and one
whose writes go unanswered for TCP_USER_TIMEOUT_MS fails rather than hangs.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from supervisor import redaction

if TYPE_CHECKING:
    import psycopg

CONNECT_S: Final = 5
TCP_USER_TIMEOUT_MS: Final = 15_000
BUSY_MS: Final = 5_000  # a SQLite writer waits this long for another's lock
MIGRATION_LOCK: Final = 0x6C75636961  # PostgreSQL advisory lock key: "lucia"
SQLITE_FILE: Final = "record.sqlite3"

Kind = Literal["sqlite", "postgresql"]
Params = Sequence[object]


class StoreFailed(Exception):
    """The database could not be opened, read or written; str() is the reason, one line."""


@dataclass(frozen=True)
class Target:
    """Where the record is: a SQLite file, or a PostgreSQL DSN (which wins)."""

    path: Path | None = None
    dsn: str | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.dsn is None):
            raise ValueError("a record is a SQLite path or a PostgreSQL DSN: one of them")

    @property
    def kind(self) -> Kind:
        return "postgresql" if self.dsn is not None else "sqlite"

    def describe(self) -> str:
        """Where, for the log and the CLI: the path, or the DSN without its password."""
        if self.dsn is None:
            return str(self.path)
        return safe_dsn(self.dsn)


def safe_dsn(dsn: str) -> str:
    """The DSN as host, port, database and user only: never a password."""
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415 - only with PostgreSQL

    try:
        parts = conninfo_to_dict(dsn)
    except Exception:  # a DSN libpq cannot parse is shown as nothing of it
        return "postgresql (a DSN libpq cannot parse)"
    password = parts.get("password")
    if isinstance(password, str):
        redaction.register([password])
    shown = " ".join(
        f"{name}={parts[name]}" for name in ("host", "port", "dbname", "user") if name in parts
    )
    return f"postgresql {shown}".rstrip()


def one_line(exc: BaseException) -> str:
    """Why a database call failed, in one line of at most 500 characters, no secret in it."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, StoreFailed):  # its text is a reason already
        text = f"{type(exc).__name__}: {text}"
    return redaction.redact(text)[:500]


class Database:
    """One connection, used by one thread at a time."""

    def __init__(self, kind: Kind, connection: Any) -> None:
        self.kind: Kind = kind
        self._conn = connection

    def sql(self, text: str) -> str:
        return text.replace("?", "%s") if self.kind == "postgresql" else text

    def execute(self, text: str, params: Params = ()) -> int:
        """Run one statement; the rows it changed (-1 when that has no meaning)."""
        return int(self._conn.execute(self.sql(text), params).rowcount)

    def executemany(self, text: str, rows: Sequence[Params]) -> None:
        if self.kind == "postgresql":
            with self._conn.cursor() as cursor:
                cursor.executemany(self.sql(text), rows)
        else:
            self._conn.executemany(text, rows)

    def bulk(self, table: str, columns: Sequence[str], rows: Sequence[Params]) -> None:
        """Insert many rows: COPY on PostgreSQL (a stream, not a statement a row), an
        executemany of one INSERT on SQLite."""
        names = ", ".join(columns)
        if self.kind == "postgresql":
            with (
                self._conn.cursor() as cursor,
                cursor.copy(f"COPY {table} ({names}) FROM STDIN") as copy,
            ):
                for row in rows:
                    copy.write_row(row)
            return
        marks = ", ".join("?" * len(columns))
        self._conn.executemany(f"INSERT INTO {table} ({names}) VALUES ({marks})", rows)  # noqa: S608 - our names

    def query(self, text: str, params: Params = ()) -> list[tuple[Any, ...]]:
        return list(self._conn.execute(self.sql(text), params).fetchall())

    def stream(
        self, text: str, params: Params = (), size: int = 10_000
    ) -> Iterator[tuple[Any, ...]]:
        """A query's rows a few thousand at a time, for a scan that may be long."""
        if self.kind == "postgresql":
            with self._conn.transaction(), self._conn.cursor(name="lucia_scan") as cursor:
                cursor.itersize = size
                cursor.execute(self.sql(text), params)
                yield from cursor
        else:
            cursor = self._conn.execute(text, params)
            while batch := cursor.fetchmany(size):
                yield from batch

    @contextmanager
    def transaction(self, migration: bool = False) -> Iterator[None]:
        """A write transaction: committed when the block ends, rolled back if it raises."""
        if self.kind == "postgresql":
            with self._conn.transaction():
                if migration:
                    self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
                yield
            return
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    @contextmanager
    def snapshot(self) -> Iterator[None]:
        """A read-only transaction: every query in it reads the same state of the database."""
        if self.kind == "postgresql":
            with self._conn.transaction():
                self._conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
                yield
            return
        self._conn.execute("BEGIN")
        try:
            yield
        finally:
            if self._conn.in_transaction:
                self._conn.execute("COMMIT")

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a connection already broken closes as it can
            self._conn.close()


def _private_file(path: Path) -> None:
    """The SQLite file exists, is a regular file of ours and is 0600 (its -wal and -shm files
    take its mode), in a 0700 directory when the directory is made here."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StoreFailed(f"{path} is not a regular file")
        if stat.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def open_sqlite(path: Path) -> Database:
    try:
        _private_file(path)
        conn = sqlite3.connect(
            path, timeout=BUSY_MS / 1000, isolation_level=None, check_same_thread=False
        )
    except (OSError, sqlite3.Error) as exc:
        raise StoreFailed(one_line(exc)) from None
    try:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise StoreFailed(f"{path}: SQLite would not use WAL here (journal_mode {mode})")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA journal_size_limit=16777216")  # the WAL shrinks back after a burst
    except sqlite3.Error as exc:
        conn.close()
        raise StoreFailed(one_line(exc)) from None
    return Database("sqlite", conn)


def open_postgres(dsn: str) -> Database:
    import psycopg  # noqa: PLC0415 - SQLite's users never load it

    try:
        conn: psycopg.Connection[tuple[Any, ...]] = psycopg.connect(
            dsn,
            autocommit=True,
            connect_timeout=CONNECT_S,
            application_name="lucia-record",
            tcp_user_timeout=TCP_USER_TIMEOUT_MS,
            keepalives_idle=10,
            keepalives_interval=5,
            keepalives_count=3,
        )
    except psycopg.Error as exc:
        raise StoreFailed(one_line(exc)) from None
    return Database("postgresql", conn)


def connect(target: Target) -> Database:
    """A connection to the target; StoreFailed with the reason when there is none."""
    if target.dsn is not None:
        return open_postgres(target.dsn)
    assert target.path is not None
    return open_sqlite(target.path)


def open_reader(target: Target) -> Database:
    """For a reader (the usage command): the database as it is; a SQLite file is never made."""
    if target.dsn is not None:
        return open_postgres(target.dsn)
    assert target.path is not None
    if not target.path.is_file():
        raise StoreFailed("nothing recorded yet: the gateway writes the record as it serves")
    try:
        conn = sqlite3.connect(
            target.path.as_uri() + "?mode=rw",
            uri=True,
            timeout=BUSY_MS / 1000,
            isolation_level=None,
        )
    except sqlite3.Error as exc:
        raise StoreFailed(one_line(exc)) from None
    return Database("sqlite", conn)


def failures() -> tuple[type[BaseException], ...]:
    """What a database call raises when the database fails: caught by the writer."""
    found: list[type[BaseException]] = [sqlite3.Error, OSError, StoreFailed]
    try:
        import psycopg  # noqa: PLC0415
    except ImportError:  # pragma: no cover - psycopg is a dependency
        return tuple(found)
    return (*found, psycopg.Error)
