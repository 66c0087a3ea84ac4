"""The fleet's catalog on a real PostgreSQL (a cluster of the module's own on 127.0.0.1), kept
by several catalogs of different machines: a change carried by NOTIFY, a killed gateway gone
stale, a clean stop removing its rows, PostgreSQL stopped and started again, PostgreSQL frozen
while the event loop goes on, hostile strings as data, tables of a newer version left alone,
a gateway publishing its engines, and a gateway process leaving the catalog as its stop begins.

Every case shares the module's cluster (one that stops or freezes it stops or freezes it for
the module), so tests/schedule.py keeps them in one process, as every module is a group."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest
import structlog

from supervisor.host import protocol as host
from supervisor.host.fleet import tables
from supervisor.host.fleet.catalog import AVAILABLE, UNAVAILABLE, FleetCatalog, Timing
from supervisor.host.fleet.choose import choose
from supervisor.host.fleet.peers import Peers
from supervisor.host.fleet.rows import PeerEngine
from supervisor.host.gateway.sections import FleetSettings
from supervisor.host.proxy import body
from supervisor.host.web.refusal import Refusal
from supervisor.protocol.documents import utc_now
from tests.gateway_proc import running_gateway
from tests.host.fleet_world import write_peers
from tests.host.gateway_world import AUTH, SETTINGS, Upstream, world, write_status
from tests.postgres import Cluster

ROOT = Path(__file__).resolve().parents[2]
# no heartbeat and no periodic read within a test: what a reader sees came by NOTIFY
NOTIFIED = Timing(publish_s=0.05, beat_s=900, wait_s=5)


def settings(machine: str, stale_s: float = 8.0) -> FleetSettings:
    return FleetSettings(
        machine=machine,
        advertise=f"http://{machine}.example:8400",
        stale_s=stale_s,
        publish_s=0.2,
    )


def notified(
    machine: str, dsn: str, rows: Callable[[], Sequence[PeerEngine]] = tuple
) -> FleetCatalog:
    """A catalog that neither beats nor reads by itself within a test (its bound an hour)."""
    return FleetCatalog(settings(machine, stale_s=3600), dsn, rows, NOTIFIED)


def engine(machine: str, name: str = "e", **extra: Any) -> PeerEngine:
    fields: dict[str, Any] = {"models": ("qwen",), "state": "running", "slots": 4, **extra}
    return PeerEngine(
        machine=machine,
        engine=name,
        url=f"http://{machine}.example:8400",
        heard=utc_now(),
        **fields,
    )


def run(scenario: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(180):  # a bound on a hang, never a measure
            await scenario

    asyncio.run(bounded())


async def eventually(check: Callable[[], bool], seconds: float = 60) -> None:
    """Wait for `check` to hold: a bound on a hang, not a timed assertion."""
    async with asyncio.timeout(seconds):
        while not check():
            await asyncio.sleep(0.02)


async def seen(catalog: FleetCatalog, check: Callable[[], bool]) -> None:
    """Wait for a read of `catalog` after which `check` holds."""
    async with asyncio.timeout(60):
        await catalog.until(check)


@asynccontextmanager
async def catalogs(*made: FleetCatalog) -> AsyncIterator[None]:
    async with AsyncExitStack() as stack:
        for catalog in made:
            await stack.enter_async_context(catalog.running())
        await eventually(lambda: all(catalog.available for catalog in made))
        yield


def rows_by_engine(found: list[PeerEngine]) -> dict[str, PeerEngine]:
    return {row.engine: row.published() for row in found}


def of(catalog: FleetCatalog, machine: str) -> list[PeerEngine]:
    return [row for row in catalog.peers(utc_now()) if row.machine == machine]


def machines(catalog: FleetCatalog) -> dict[str, bool]:
    """Machine name -> stale, as `catalog` lists them now."""
    return {machine.name: machine.stale for machine in catalog.machines(utc_now())}


def events(logs: Sequence[Mapping[str, Any]], event: str, machine: str) -> int:
    return sum(1 for line in logs if line["event"] == event and line.get("machine") == machine)


def test_a_change_reaches_every_other_machine_by_its_notification(postgres: Cluster) -> None:
    dsn = postgres.database()
    published = [engine("a"), engine("a", "f", state="stopped")]
    a = notified("a", dsn, lambda: published)
    b = notified("b", dsn, lambda: [engine("b", "x", models=("bert",))])
    c = notified("c", dsn)

    async def scenario() -> None:
        async with catalogs(a, b, c):
            await seen(b, lambda: "e" in rows_by_engine(b.peers(utc_now())))
            await seen(c, lambda: "e" in rows_by_engine(c.peers(utc_now())))
            assert {row.machine for row in b.peers(utc_now())} == {"a"}  # never its own
            assert machines(a) == {"a": False, "b": False, "c": False}
            before = b.notified
            published[:] = [engine("a", running=3, waiting=1), engine("a", "g", models=("m",))]
            expected = rows_by_engine(published)
            await seen(b, lambda: rows_by_engine(b.peers(utc_now())) == expected)
            await seen(c, lambda: rows_by_engine(of(c, "a")) == expected)
            assert rows_by_engine(of(c, "b")) == rows_by_engine(
                [engine("b", "x", models=("bert",))]
            )
            assert b.notified > before and b.beats == 0  # no heartbeat, no periodic read yet
            assert a.peers(utc_now())[0].engine == "x"

    run(scenario())


@pytest.mark.alone  # a live machine's heartbeat age, on a machine of two cores: nothing beside
def test_a_killed_gateway_goes_stale_and_a_live_one_never_does(
    postgres: Cluster, tmp_path: Path
) -> None:
    dsn = postgres.database()
    reader = FleetCatalog(settings("reader", stale_s=4), dsn)
    ever_stale: list[dict[str, bool]] = []

    async def scenario() -> None:
        with (tmp_path / "child.log").open("wb") as err:
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.fleet_child", dsn, "gone", "4",
                stdout=asyncio.subprocess.PIPE, stderr=err, cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
        try:
            assert child.stdout is not None
            assert await child.stdout.readline() == b"joined\n", (
                tmp_path / "child.log"
            ).read_text()
            async with catalogs(reader):
                await seen(reader, lambda: machines(reader).get("gone") is False)
                os.kill(child.pid, signal.SIGKILL)
                await child.wait()

                def gone_stale() -> bool:
                    listed = machines(reader)
                    if listed and listed.get("reader") is not False:  # listed: available
                        ever_stale.append(listed)
                    return listed.get("gone") is True

                await eventually(gone_stale)
                (row,) = reader.peers(utc_now())  # kept, stale: never routed to
                assert (row.machine, row.engine, row.state) == ("gone", "e", "running")
                with pytest.raises(Refusal) as refused:
                    choose("qwen", body.CHAT, [row], utc_now(), reader.stale_s)
                assert (refused.value.status, refused.value.code) == (503, "model_not_loaded")
                assert refused.value.details == {"machines": ["gone"]}
        finally:
            if child.returncode is None:
                child.kill()
                await child.wait()

    run(scenario())
    assert ever_stale == []


def test_a_clean_stop_removes_the_machines_rows(postgres: Cluster) -> None:
    dsn = postgres.database()
    a = notified("a", dsn, lambda: [engine("a")])
    b = notified("b", dsn)

    async def scenario() -> None:
        async with catalogs(b):
            async with catalogs(a):
                await seen(b, lambda: "a" in machines(b))
            await seen(b, lambda: "a" not in machines(b))
            assert b.peers(utc_now()) == []
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                for table in ("fleet_machines", "fleet_engines"):
                    found = await conn.execute(f"SELECT count(*) FROM {table} WHERE machine = 'a'")
                    assert await found.fetchone() == (0,)

    run(scenario())


def test_postgresql_stopped_then_started_says_so_once_and_reads_again(postgres: Cluster) -> None:
    dsn = postgres.database()
    a = FleetCatalog(settings("a"), dsn, lambda: [engine("a")])
    b = FleetCatalog(settings("b"), dsn, lambda: [engine("b")])

    async def scenario() -> None:
        async with catalogs(a, b):
            await seen(b, lambda: bool(b.peers(utc_now())))
            try:
                await asyncio.to_thread(postgres.stop)
                await eventually(lambda: not a.available and not b.available)
                assert b.peers(utc_now()) == [] and b.machines(utc_now()) == []
                assert a.reason is not None
            finally:
                if not postgres.running():
                    await asyncio.to_thread(postgres.start)
            await eventually(lambda: a.available and b.available)
            await seen(b, lambda: [row.machine for row in b.peers(utc_now())] == ["a"])
            await seen(a, lambda: [row.machine for row in a.peers(utc_now())] == ["b"])

    with structlog.testing.capture_logs() as logs:
        run(scenario())
    for machine in ("a", "b"):
        assert events(logs, UNAVAILABLE, machine) == 1, logs
        assert events(logs, AVAILABLE, machine) == 1, logs


@pytest.mark.alone  # the loop's longest gap, on a machine of two cores: nothing runs beside it
def test_a_frozen_postgresql_never_stalls_the_event_loop(postgres: Cluster) -> None:
    """SIGSTOP: a server that neither fails nor answers. Each call is waited for wait_s at
    most, in a task of its own: a loop blocked on one would miss its ticks for the whole
    freeze (several wait_s), so the ticker's longest gap stays below wait_s."""
    dsn = postgres.database()
    a = FleetCatalog(settings("a"), dsn, lambda: [engine("a")])
    b = FleetCatalog(settings("b"), dsn, lambda: [engine("b")])
    gaps: list[float] = []

    async def ticker(stop: asyncio.Event) -> None:
        clock = asyncio.get_running_loop()
        last = clock.time()
        while not stop.is_set():
            await asyncio.sleep(0.01)
            now = clock.time()
            gaps.append(now - last)
            last = now

    async def scenario() -> None:
        async with catalogs(a, b):
            await seen(b, lambda: bool(b.peers(utc_now())))
            stop = asyncio.Event()
            ticks = asyncio.create_task(ticker(stop))
            postgres.freeze()
            try:
                await eventually(lambda: not a.available and not b.available)
                assert b.peers(utc_now()) == []
                assert "did not answer" in str(a.reason)
                await asyncio.sleep(3 * a.timing.wait_s)  # reconnections tried, and waited
            finally:
                postgres.thaw()
            await eventually(lambda: a.available and b.available)
            await seen(b, lambda: [row.machine for row in b.peers(utc_now())] == ["a"])
            stop.set()
            await ticks

    with structlog.testing.capture_logs() as logs:
        run(scenario())
    assert len(gaps) > 100
    assert max(gaps) < a.timing.wait_s
    for machine in ("a", "b"):
        assert events(logs, UNAVAILABLE, machine) == 1, logs
        assert events(logs, AVAILABLE, machine) == 1, logs


HOSTILE = [
    "'; DROP TABLE fleet_engines; --",
    "nul\x00inside",
    "\x1b[31mred\x1b[0m\r\nnext",
    "ünï€ødé 🚀 \u2028",
    "lone \ud800 surrogate",
    '"quoted" \\back\\slash %s %(x)s {}',
]


def test_hostile_strings_are_data_and_a_foreign_row_is_left_out(postgres: Cluster) -> None:
    dsn = postgres.database()
    published = [
        engine(
            "a",
            name,
            models=tuple(HOSTILE),
            declared={name: ("chat",)},
            build=name,
            weights=name,
            plan=name,
        )
        for name in HOSTILE
    ]
    a = notified("a", dsn, lambda: published)
    b = notified("b", dsn)

    async def scenario() -> None:
        async with catalogs(a, b):
            expected = rows_by_engine(published)
            await seen(b, lambda: rows_by_engine(b.peers(utc_now())) == expected)
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await conn.execute(
                    "INSERT INTO fleet_engines (machine, engine, doc) VALUES "
                    "('a', '\"junk\"', 'not json'), ('a', 'not a key', '{}'), "
                    "('a', '\"typed\"', '{\"models\": 5}')"
                )
                await conn.execute(
                    "INSERT INTO fleet_machines (machine, doc, heard, version) VALUES "
                    "('rogue', '{\"url\": \"javascript:alert(1)\"}', now(), 1)"
                )
                for payload in ("a", "rogue", "\x1b[2J'; --", ""):
                    await conn.execute("SELECT pg_notify(%s, %s)", (tables.CHANNEL, payload))
            await seen(b, lambda: b.notified >= 4)
            assert b.available
            assert rows_by_engine(b.peers(utc_now())) == expected
            assert set(machines(b)) == {"a", "b"}
            published.append(engine("a", "after"))  # the listener goes on
            await seen(b, lambda: "after" in rows_by_engine(b.peers(utc_now())))

    run(scenario())


def test_tables_of_a_newer_version_are_left_alone(postgres: Cluster) -> None:
    dsn = postgres.database()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE fleet_schema (version BIGINT NOT NULL)")
        conn.execute("INSERT INTO fleet_schema VALUES (99)")
    a = FleetCatalog(settings("a"), dsn, lambda: [engine("a")])

    async def scenario() -> None:
        async with a.running():
            await eventually(lambda: a.reason is not None)
            assert not a.available and "version 99" in str(a.reason)

    run(scenario())
    with psycopg.connect(dsn) as conn:
        found = conn.execute("SELECT to_regclass('fleet_machines')").fetchone()
        assert found == (None,)


def test_gateways_starting_at_once_make_the_tables_once(postgres: Cluster) -> None:
    dsn = postgres.database()
    made = [FleetCatalog(settings(f"m{n}"), dsn, lambda: ()) for n in range(4)]

    async def scenario() -> None:
        async with catalogs(*made):
            await seen(made[0], lambda: len(machines(made[0])) == 4)

    run(scenario())
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT version FROM fleet_schema").fetchall() == [(tables.VERSION,)]


def fleet_settings(dsn: str) -> str:
    return SETTINGS + (
        f'[record]\ndsn = "{dsn}"\n'
        '[fleet]\nmachine = "gw"\nadvertise = "http://127.0.0.1:8400"\n'
        "stale_s = 8\npublish_s = 0.2\n"
    )


def test_a_gateway_publishes_its_engines_and_withdraws_them_at_its_stop(
    postgres: Cluster, tmp_path: Path
) -> None:
    dsn = postgres.database()
    reader = notified("reader", dsn)
    upstream = Upstream(hold=asyncio.Event())

    def row(name: str) -> PeerEngine | None:
        return next((r for r in reader.peers(utc_now()) if r.engine == name), None)

    async def ask(session: aiohttp.ClientSession, base: str) -> None:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        async with session.post(f"{base}/chat/completions", json=chat, headers=AUTH) as answer:
            assert answer.status == 200
            await answer.read()

    async def scenario() -> None:
        async with catalogs(reader):
            peers = tmp_path / "peers.keys"
            write_peers(peers, {"gw": secrets.token_urlsafe(32)})
            fleet = Peers.open(peers, "gw")
            async with world(tmp_path, fleet_settings(dsn), upstream, peers=fleet) as w:
                assert w.app.fleet is not None
                write_status(w.data, "small", "running", url=upstream.url, slots={"tiny": 2})
                write_status(w.data, "big", "stopped", models=("huge",))
                host.request(w.data, "big", "stopped", "operator")
                await seen(reader, lambda: row("small") is not None and row("big") is not None)
                small, big = row("small"), row("big")
                assert small is not None and big is not None
                assert (small.machine, small.url, small.state, small.slots) == (
                    "gw", "http://127.0.0.1:8400", "running", 2)  # fmt: skip
                assert (big.state, big.models, big.stopped_by_operator) == (
                    "stopped", ("huge",), True)  # fmt: skip
                async with aiohttp.ClientSession() as session:
                    asked = asyncio.create_task(ask(session, w.base))
                    await seen(reader, lambda: getattr(row("small"), "running", 0) == 1)
                    assert upstream.hold is not None
                    upstream.hold.set()
                    await asked
                await seen(reader, lambda: getattr(row("small"), "running", 1) == 0)
            await seen(reader, lambda: "gw" not in machines(reader))  # withdrawn at its stop

    run(scenario())


def test_a_gateway_process_leaves_the_catalog_as_its_stop_begins(
    postgres: Cluster, tmp_path: Path
) -> None:
    """SIGTERM: the machine's rows go with /healthz's 503, before the drain and the shutdown."""
    dsn = postgres.database()
    data = tmp_path / "data"
    data.mkdir()
    write_status(data, "small", "stopped", models=("tiny",))
    reader = notified("reader", dsn)
    peers = tmp_path / "peers.keys"
    write_peers(peers, {"gw": secrets.token_urlsafe(32)})
    fleet = (
        f'[record]\ndsn = "{dsn}"\n[fleet]\nmachine = "gw"\npeers_file = "{peers}"\n'
        'advertise = "http://127.0.0.1:8400"\nstale_s = 8\npublish_s = 0.2\n'
    )
    with running_gateway(tmp_path / "gw", data, fleet, listen="drain_s = 1\n") as gw:

        async def scenario() -> None:
            async with catalogs(reader):
                await seen(reader, lambda: [r.engine for r in of(reader, "gw")] == ["small"])
                gw.proc.send_signal(signal.SIGTERM)
                await seen(reader, lambda: "gw" not in machines(reader))

        run(scenario())
        assert gw.proc.wait(60) == 0
    said = gw.log_text()
    assert said.count("fleet joined") == 1 and said.count("fleet left") == 1, said[-3000:]
    assert "fleet unavailable" not in said
    order = [said.index(line) for line in ("fleet left", "gateway draining", "gateway stopping")]
    assert order == sorted(order), said[-3000:]
