"""What the record's tests share: a row to vary, a wait, the facts of a database after a crash,
and a writer in a child process that a test kills."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from supervisor.host.record import batch, schema
from supervisor.host.record.database import Database, Target
from supervisor.host.record.row import Build, Row

ROOT = Path(__file__).resolve().parents[1]
KEY = "key_0123456789ab"
OTHER = "key_ba9876543210"
NOW = datetime(2026, 5, 4, 12, 0, tzinfo=UTC)


def row(
    at: datetime | None = None,
    *,
    key_id: str = KEY,
    model: str = "m1",
    engine: str = "e1",
    build: Build | None = None,
    outcome: str = "ok",
    prompt: int | None = 10,
    completion: int | None = 20,
    cached: int | None = None,
    wait_s: float = 0.01,
    ttft_s: float | None = 0.1,
    duration_s: float = 1.0,
    machine: str | None = None,
) -> Row:
    return Row(
        at=at or datetime.now(UTC),
        key_id=key_id,
        model=model,
        engine=engine,
        build=build or Build(),
        outcome=outcome,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        wait_s=wait_s,
        ttft_s=ttft_s,
        duration_s=duration_s,
        machine=machine,
    )


def until(check: Callable[[], Any], seconds: float = 60.0, what: str = "the condition") -> Any:
    """Wait for check() to be truthy; its value. A bound on a hang, not a timed assertion."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:g} s"
        time.sleep(0.02)


def days_ago(days: float) -> datetime:
    return datetime.now(UTC) - timedelta(days=days)


@dataclass(frozen=True)
class Facts:
    """What a database holds after a run: the ids (prompt tokens) of its rows, and whether its
    daily totals are exactly the sums of its rows."""

    ids: list[int]
    totals_match: bool


def facts(db: Database) -> Facts:
    ids = [int(found[0]) for found in db.query("SELECT prompt_tokens FROM generations")]
    sums = db.query(
        "SELECT key_id, COUNT(*), SUM(COALESCE(prompt_tokens, 0) + COALESCE(completion_tokens, 0)) "
        "FROM generations GROUP BY key_id ORDER BY key_id"
    )
    totals = db.query(
        "SELECT key_id, SUM(requests), SUM(tokens) FROM daily_totals GROUP BY key_id "
        "ORDER BY key_id"
    )
    as_ints = [tuple(int(v) if not isinstance(v, str) else v for v in t) for t in sums]
    totals_ints = [tuple(int(v) if not isinstance(v, str) else v for v in t) for t in totals]
    return Facts(sorted(ids), as_ints == totals_ints)


@dataclass(frozen=True)
class Killed:
    """A child writer's run: each row it reported answered (id -> when, its monotonic clock,
    which is the machine's), and when it was killed."""

    answered: dict[int, float]
    killed_at: float
    log: str


def run_and_kill(target: Target, rows: int, log: Path) -> Killed:
    """Start tests/record_child.py on target, read its reports until `rows` were answered,
    SIGKILL it there, mid-load, and collect what it reported."""
    kind, where = ("sqlite", str(target.path)) if target.dsn is None else ("postgresql", target.dsn)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as err:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.record_child", kind, where],
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=ROOT,
            env=env,
        )
    assert child.stdout is not None
    answered: dict[int, float] = {}
    killed_at = 0.0
    try:
        for line in child.stdout:
            number, when = line.split()
            answered[int(number)] = float(when)
            if len(answered) >= rows:
                killed_at = time.monotonic()
                os.kill(child.pid, signal.SIGKILL)
                break
    finally:
        if not killed_at:
            child.kill()
        child.wait(30)
    for line in child.stdout:  # reported before the kill, read after it
        number, when = line.split()
        answered[int(number)] = float(when)
    child.stdout.close()
    assert killed_at, f"the child ended by itself: {log.read_text()[-2000:]}"
    return Killed(answered, killed_at, log.read_text())


V2_COLUMNS = 15  # batch.COLUMNS of schema version 2: every column but the machine


def at_version_2(db: Database) -> None:
    """A record as a lucia-supervisor of schema version 2 left it, with one row (prompt 1)."""
    with db.transaction(migration=True):
        db.execute("CREATE TABLE schema_version (version BIGINT NOT NULL)")
        for statements in schema.MIGRATIONS[:2]:
            for statement in statements:
                db.execute(statement)
        db.execute("INSERT INTO schema_version (version) VALUES (2)")
        old = batch.values(row(prompt=1))[:V2_COLUMNS]
        db.bulk("generations", batch.COLUMNS[:V2_COLUMNS], [old])
