"""The fleet's catalog as one gateway keeps it: its own rows published, the others' read.

Two connections of psycopg's AsyncConnection, so that nothing waits on the event loop: one
publishes and reads, the other LISTENs. Every publish_s the gateway's rows are asked for
(`rows`, a callable: rows.rows_of over its engines now) and, when any changed, published in one
transaction with `NOTIFY lucia_fleet, '<machine>'`; whether or not anything changed, the
machine's heartbeat is written every stale_s / 4, so a live machine is never seen older than
about half the bound (a heartbeat's interval, plus a reader's). A notification rereads its
machine; every machine is read again every stale_s / 4 too (a notification lost, a heartbeat),
and on every (re)connection.

Each database call is a task of its own, waited for stale_s / 4 at most: one that is not
answered by then (PostgreSQL frozen) is left to end by itself, and its connection with it. A
fault on either connection makes the catalog unavailable: `fleet unavailable` is logged once
with the reason, `peers()` and `machines()` answer nothing (the gateway serves its own engines
and forwards nothing), and the catalog connects again by itself, after 0.1 s, doubling to
stale_s / 4; once both connections serve again, `fleet available` is logged once. At a clean
stop (`withdraw`, the app's shutdown) this machine's rows are removed and its readers told.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, TypeVar

import psycopg

from supervisor import logs
from supervisor.host.fleet import tables
from supervisor.host.fleet.rows import Machine, PeerEngine
from supervisor.host.record.database import TCP_USER_TIMEOUT_MS, StoreFailed, one_line, safe_dsn
from supervisor.protocol.documents import utc_now

if TYPE_CHECKING:
    from aiohttp import web
    from psycopg import AsyncConnection

    from supervisor.host.gateway.sections import FleetSettings

UNAVAILABLE: Final = "fleet unavailable"
AVAILABLE: Final = "fleet available"
JOINED: Final = "fleet joined"
LEFT: Final = "fleet left"
RETRY_S: Final = 0.1  # the first reconnection's delay; it doubles up to stale_s / 4
MAX_PENDING: Final = 1000  # machines named by notifications before a read of every machine
FAULTS: Final = (psycopg.Error, OSError, StoreFailed, TimeoutError)
log = logs.get("gateway")
T = TypeVar("T")


@dataclass(frozen=True)
class Timing:
    """How often the catalog publishes, beats and reads, and how long a call is waited for."""

    publish_s: float
    beat_s: float
    wait_s: float
    retry_s: float = RETRY_S

    @classmethod
    def of(cls, settings: FleetSettings) -> Timing:
        quarter = settings.stale_s / 4
        return cls(publish_s=settings.publish_s, beat_s=quarter, wait_s=quarter)


class FleetCatalog:
    """This machine's rows in the shared catalog, and every machine's as last read."""

    def __init__(
        self,
        settings: FleetSettings,
        dsn: str,
        rows: Callable[[], Sequence[PeerEngine]] = tuple,
        timing: Timing | None = None,
    ) -> None:
        self.machine = settings.machine
        self.url = settings.advertise
        self.stale_s = settings.stale_s
        self.dsn = dsn
        self.rows = rows
        self.timing = timing or Timing.of(settings)
        self.where = safe_dsn(dsn)
        self.reason: str | None = None  # why it is unavailable, while it is
        self.publishes = self.beats = self.reads = self.notified = 0  # counted, for the tests
        self._state: bool | None = None  # None: not joined yet
        self._up: set[str] = set()  # "catalog", "listen": the connections serving
        self._known: dict[str, tables.Known] = {}
        self._read_at: datetime | None = None
        self._published: dict[str, PeerEngine] | None = None  # None: publish every row
        self._pending: set[str] = set()
        self._everything = True
        self._wake = asyncio.Event()
        self._read = asyncio.Event()  # set, then replaced, at each read: `until` waits on it
        self._leaving = asyncio.Event()
        self._gone = asyncio.Event()
        self._leftovers: set[asyncio.Future[Any]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    # -- what the gateway asks --------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._state is True

    def peers(self, now: datetime) -> list[PeerEngine]:
        """Every other machine's rows, stale ones too (choose.py tells them apart); nothing
        while the catalog is unavailable or was last read more than stale_s before `now`."""
        if not self._current(now):
            return []
        return [
            row
            for name, known in sorted(self._known.items())
            if name != self.machine
            for row in known.engines
        ]

    def machines(self, now: datetime) -> list[Machine]:
        """Every machine as last read, this one too, by name; nothing while unavailable."""
        return listing(self._known.values(), now, self.stale_s) if self._current(now) else []

    def _current(self, now: datetime) -> bool:
        read = self._read_at
        return self.available and read is not None and now - read <= timedelta(seconds=self.stale_s)

    async def until(self, check: Callable[[], bool]) -> None:
        """Wait until `check()` holds after a read of the catalog (bound it with a timeout)."""
        while not check():
            await self._read.wait()

    # -- its life ---------------------------------------------------------------------------

    async def task(self, _: web.Application) -> AsyncIterator[None]:
        """The app's cleanup context: the catalog runs while the app does."""
        async with self.running():
            yield

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self._tasks = [
            asyncio.create_task(self._keep(), name="fleet catalog"),
            asyncio.create_task(self._listen(), name="fleet notifications"),
        ]
        try:
            yield
        finally:
            await self.withdraw()
            for task in self._tasks:
                task.cancel()
            await asyncio.wait(self._tasks)  # each ends at once: its calls are tasks of their own
            if self._leftovers:  # a call left to end by itself, a connection to close
                await asyncio.wait(self._leftovers, timeout=self.timing.wait_s)

    async def withdraw(self, _: web.Application | None = None) -> None:
        """This machine's rows removed, its readers told, nothing published again (the app's
        shutdown, before the requests in flight end); waited for stale_s / 2 at most."""
        self._leaving.set()
        self._wake.set()
        if any(not task.done() for task in self._tasks):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gone.wait(), 2 * self.timing.wait_s)

    async def _keep(self) -> None:
        """The publishing and reading connection, made again after each fault."""
        delay = self.timing.retry_s
        while True:
            conn, reads = None, self.reads
            try:
                conn = await self._call(_connect(self.dsn, self.timing.wait_s), "a connection")
                await self._call(tables.migrate(conn), "making the catalog's tables")
                self._published, self._everything = None, True
                await self._serve(conn)
            except FAULTS as exc:
                self._fault("catalog", exc)
            except Exception as exc:  # never a reason to stop keeping the catalog
                log.exception("fleet catalog: an unexpected error", machine=self.machine)
                self._fault("catalog", exc)
            finally:
                if conn is not None:
                    self._retire(conn)
            delay = self.timing.retry_s if self.reads > reads else delay  # it served a while
            await asyncio.sleep(delay)  # at most stale_s / 4: a withdrawal waits twice that
            delay = min(2 * delay, self.timing.beat_s)

    async def _serve(self, conn: AsyncConnection[tuple[Any, ...]]) -> None:
        clock = asyncio.get_running_loop()
        publish_at = beat_at = read_at = 0.0
        while True:
            self._wake.clear()
            now = clock.time()
            if self._leaving.is_set():
                if not self._gone.is_set():
                    await self._call(tables.withdraw(conn, self.machine), "removing this machine")
                    self._gone.set()
                    log.info(LEFT, machine=self.machine)
                publish_at = beat_at = math.inf
            if now >= publish_at:
                publish_at = now + self.timing.publish_s
                if await self._publish(conn):
                    beat_at = now + self.timing.beat_s
            if now >= beat_at:
                beat_at = now + self.timing.beat_s
                if await self._call(tables.beat(conn, self.machine), "the heartbeat"):
                    self.beats += 1
                else:  # its rows were removed (a clean stop under the same name): again
                    self._published, publish_at = None, now
            if self._everything or now >= read_at:
                self._everything, names = False, None
                read_at = now + self.timing.beat_s
                self._pending.clear()
            else:
                names = sorted(self._pending)
                self._pending.clear()
            if names is None or names:
                self._take(await self._call(tables.read(conn, names), "a read"), names)
            self._ready("catalog")
            due = min(publish_at, beat_at, read_at) - clock.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, due))

    async def _publish(self, conn: AsyncConnection[tuple[Any, ...]]) -> bool:
        """This machine's rows, when any changed since the last publish; whether it wrote."""
        rows = {row.engine: row for row in self.rows()}
        before = self._published
        changed = [
            row
            for name, row in rows.items()
            if before is None or name not in before or before[name].published() != row.published()
        ]
        if before is not None and not changed and before.keys() == rows.keys():
            return False
        await self._call(
            tables.publish(conn, self.machine, self.url, changed, rows), "publishing this machine"
        )
        self._published = rows
        self.publishes += 1
        return True

    def _take(self, found: dict[str, tables.Known], names: list[str] | None) -> None:
        if names is None:
            self._known = found
        else:
            for name in names:
                if name in found:
                    self._known[name] = found[name]
                else:
                    self._known.pop(name, None)
        self._read_at = utc_now()
        self.reads += 1
        self._read.set()
        self._read = asyncio.Event()

    async def _listen(self) -> None:
        """The LISTEN connection, made again after each fault; each notification names the
        machine whose rows to read again."""
        delay = self.timing.retry_s
        while True:
            conn = None
            try:
                conn = await self._call(_connect(self.dsn, self.timing.wait_s), "a connection")
                await self._call(conn.execute(f"LISTEN {tables.CHANNEL}"), "LISTEN")
                self._everything = True  # what was said while nobody listened
                self._up.discard("catalog")  # the other connection too, proved by that read
                self._wake.set()
                self._ready("listen")
                delay = self.timing.retry_s
                async for note in conn.notifies():
                    self.notified += 1
                    if note.payload == self.machine:  # its own publish: read with the others
                        continue
                    self._pending.add(note.payload)
                    if len(self._pending) > MAX_PENDING:
                        self._everything = True
                    self._wake.set()
            except FAULTS as exc:
                self._fault("listen", exc)
            finally:
                if conn is not None:
                    self._retire(conn)
            self._up.discard("listen")
            await asyncio.sleep(delay)
            delay = min(2 * delay, self.timing.beat_s)

    # -- faults -----------------------------------------------------------------------------

    async def _call(self, work: Coroutine[Any, Any, T], what: str) -> T:
        """`work` as a task of its own, waited for wait_s at most: TimeoutError after that,
        and the task is left to end by itself (psycopg cancels its query, or drops it)."""
        task = asyncio.ensure_future(work)
        try:
            done, _ = await asyncio.wait({task}, timeout=self.timing.wait_s)
        except asyncio.CancelledError:
            self._abandon(task)
            raise
        if not done:
            self._abandon(task)
            raise TimeoutError(f"PostgreSQL did not answer {what} in {self.timing.wait_s:g} s")
        return task.result()

    def _abandon(self, task: asyncio.Future[Any]) -> None:
        task.cancel()
        self._leftovers.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Future[Any]) -> None:
        self._leftovers.discard(task)
        if task.cancelled() or task.exception() is not None:
            return
        found = task.result()  # a connection made after all: closed
        if isinstance(found, psycopg.AsyncConnection):
            self._retire(found)

    def _retire(self, conn: AsyncConnection[tuple[Any, ...]]) -> None:
        """Close `conn` once every call left to end by itself has ended (none uses it then)."""
        pending = [task for task in self._leftovers if not task.done()]

        async def close() -> None:
            if pending:
                await asyncio.wait(pending)
            with contextlib.suppress(Exception):
                await conn.close()

        closing = asyncio.ensure_future(close())
        self._leftovers.add(closing)
        closing.add_done_callback(self._leftovers.discard)

    def _fault(self, part: str, exc: BaseException) -> None:
        self._up.discard(part)
        if self._state is not False:
            self._state = False
            self.reason = (
                exc.args[0] if isinstance(exc, TimeoutError) and exc.args else one_line(exc)
            )
            log.warning(UNAVAILABLE, reason=self.reason, machine=self.machine, where=self.where)

    def _ready(self, part: str) -> None:
        self._up.add(part)
        if self._state is not True and self._up >= {"catalog", "listen"}:
            said = JOINED if self._state is None else AVAILABLE
            self._state, self.reason = True, None
            log.info(said, machine=self.machine, where=self.where, machines=len(self._known))


def listing(known: Iterable[tables.Known], now: datetime, stale_s: float) -> list[Machine]:
    """Pure: the machines, by name, each stale or not at `now`."""
    bound = timedelta(seconds=stale_s)
    return [
        Machine(k.name, k.url, k.heard, now - k.heard > bound, k.engines)
        for k in sorted(known, key=lambda machine: machine.name)
    ]


async def snapshot(dsn: str, wait_s: float) -> list[tables.Known] | None:
    """Every machine as the catalog holds it now, read once (the CLI); None while no gateway
    has made the catalog's tables. TimeoutError when PostgreSQL does not answer in 2 wait_s."""
    async with asyncio.timeout(2 * wait_s):
        conn = await _connect(dsn, wait_s)
        try:
            if not await tables.made(conn):
                return None
            return list((await tables.read(conn, None)).values())
        finally:
            await conn.close()


async def _connect(dsn: str, wait_s: float) -> AsyncConnection[tuple[Any, ...]]:
    return await psycopg.AsyncConnection.connect(
        dsn,
        autocommit=True,
        connect_timeout=max(2, math.ceil(wait_s)),
        application_name="lucia-fleet",
        tcp_user_timeout=TCP_USER_TIMEOUT_MS,
        keepalives_idle=10,
        keepalives_interval=5,
        keepalives_count=3,
    )
