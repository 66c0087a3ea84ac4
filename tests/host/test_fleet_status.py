"""`lucia-supervisor status --fleet` on a real PostgreSQL (a cluster of the module's own): every
machine's engines, a stale one said and its exit status 3, another machine's hostile strings
shown as data; the fleet off, no catalog yet, PostgreSQL unreachable or frozen, each said plainly
with its exit status."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import psycopg
import pytest

from supervisor import cli
from supervisor.console import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_UNANSWERED
from supervisor.host.fleet import tables
from supervisor.host.fleet.rows import PeerEngine
from supervisor.protocol.documents import utc_now
from tests.postgres import Cluster
from tests.standin import free_port

HOSTILE = "\x1b[2Jevil\x07 \ud800"


def settings_file(tmp_path: Path, dsn: str, fleet: bool = True) -> Path:
    path = tmp_path / "gateway.toml"
    text = f'[record]\ndsn = "{dsn}"\n'
    if fleet:
        text += '[fleet]\nmachine = "cli"\nadvertise = "http://127.0.0.1:8400"\nstale_s = 60\n'
    path.write_text(text)
    return path


def row(machine: str, engine: str, **extra: Any) -> PeerEngine:
    fields: dict[str, Any] = {"models": ("qwen", "bert"), "state": "running", **extra}
    return PeerEngine(
        machine=machine, engine=engine, url=f"http://{machine}:8400", heard=utc_now(), **fields
    )


def publish(dsn: str) -> None:
    """Machine `gpu-a` heard now, `old` an hour ago, `empty` with no engine."""

    async def made() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await tables.migrate(conn)
            engines = [row("gpu-a", "vllm", running=2, waiting=1), row("gpu-a", "small")]
            await tables.publish(conn, "gpu-a", "http://gpu-a:8400", engines, ["vllm", "small"])
            old = [row("old", HOSTILE, models=(HOSTILE,), state="stopped")]
            await tables.publish(conn, "old", "http://old:8400", old, [HOSTILE])
            await tables.publish(conn, "empty", "http://empty:8400", [], [])
            await conn.execute(
                "UPDATE fleet_machines SET heard = now() - interval '1 hour' WHERE machine = 'old'"
            )

    asyncio.run(made())


def test_every_machines_engines_and_a_stale_one(
    postgres: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = postgres.database()
    publish(dsn)
    settings = settings_file(tmp_path, dsn)
    assert cli.main(["status", "--fleet", "--settings", str(settings)]) == EXIT_UNANSWERED
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == ["MACHINE", "ENGINE", "STATE", "RUN/WAIT", "HEARD", "MODELS"]
    assert lines[1][:3] == ["empty", "-", "-"]
    assert lines[2][:4] == ["gpu-a", "small", "running", "0/0"]
    assert lines[3][:4] == ["gpu-a", "vllm", "running", "2/1"]
    assert lines[3][-2:] == ["qwen,", "bert"]
    shown = out.splitlines()
    assert lines[4][0] == "old" and "s ago (stale)" in shown[4]
    assert all("s ago" in line and "stale" not in line for line in shown[1:4])
    assert "\x1b" not in out and "\x07" not in out
    assert "?[2Jevil? \\ud800" in out

    assert cli.main(["status", "--fleet", "--json", "--settings", str(settings)]) == 3
    listed = json.loads(capsys.readouterr().out)
    assert [(m["machine"], m["stale"]) for m in listed] == [
        ("empty", False),
        ("gpu-a", False),
        ("old", True),
    ]
    (stale,) = listed[2]["engines"]
    assert (stale["engine"], stale["models"], stale["state"]) == (HOSTILE, [HOSTILE], "stopped")
    assert listed[1]["engines"][1]["running"] == 2 and listed[1]["url"] == "http://gpu-a:8400"


def test_names_keep_the_machines_with_those_engines(
    postgres: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = postgres.database()
    publish(dsn)
    settings = settings_file(tmp_path, dsn)
    assert cli.main(["status", "--fleet", "vllm", "--settings", str(settings)]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["MACHINE", "ENGINE"], ["gpu-a", "vllm"]]


def test_before_any_gateway_made_the_catalog(
    postgres: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = settings_file(tmp_path, postgres.database())
    assert cli.main(["status", "--fleet", "--settings", str(settings)]) == EXIT_OK
    assert "no gateway has made the catalog yet" in capsys.readouterr().out


def test_the_fleet_off_is_a_settings_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = settings_file(tmp_path, "postgresql://lucia@127.0.0.1:1/x", fleet=False)
    assert cli.main(["status", "--fleet", "--settings", str(settings)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"the fleet is off in {settings}: [fleet] machine is not set" in err


def test_postgresql_unreachable_is_said_without_its_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()  # nothing listens there
    settings = settings_file(tmp_path, f"postgresql://lucia:hunter2-secret@127.0.0.1:{port}/x")
    assert cli.main(["status", "--fleet", "--settings", str(settings)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"the fleet's catalog (postgresql host=127.0.0.1 port={port}" in err
    assert "Connection refused" in err and "hunter2" not in err


def test_a_frozen_postgresql_is_waited_for_a_bound(
    postgres: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = postgres.database()
    publish(dsn)
    settings = settings_file(tmp_path, dsn)
    postgres.freeze()
    try:
        assert cli.main(["status", "--fleet", "--settings", str(settings)]) == EXIT_FAILED
    finally:
        postgres.thaw()
    err = capsys.readouterr().err  # the connection's own timeout (5 s), else the whole read's
    assert "connection timeout expired" in err or "PostgreSQL did not answer in 10 s" in err
