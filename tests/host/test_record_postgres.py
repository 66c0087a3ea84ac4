"""The record on a real PostgreSQL (Debian's, a cluster of the module's own on 127.0.0.1): the
same schema as SQLite, gateways sharing one record and budget, a bad DSN, PostgreSQL stopped
mid-load and started again, a SIGKILL mid-load, and the usage figures.

Every case here shares the module's cluster, so tests/schedule.py keeps them in one process
(a module is a group of its own)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import structlog

from supervisor.host.gateway.recording import Request, row_of
from supervisor.host.proxy.forward import Trace
from supervisor.host.record import batch, queries, schema
from supervisor.host.record.database import Target, open_postgres, open_sqlite
from supervisor.host.record.ledger import Spent
from supervisor.host.record.row import Build, refused
from supervisor.host.record.store import Store
from supervisor.host.record.writer import COMMITTED_WITHIN_S, UNAVAILABLE, WriterTuning
from supervisor.protocol.names import digest_form
from tests.postgres import Cluster
from tests.record_world import (
    KEY,
    OTHER,
    at_version_2,
    days_ago,
    facts,
    row,
    run_and_kill,
    until,
)
from tests.standin import free_port
from tests.support import within

FAST = WriterTuning(backoff_s=0.05, backoff_max_s=0.5)


@pytest.fixture
def stores() -> Iterator[Any]:
    opened: list[Store] = []

    def make(dsn: str, retention_days: int = 0, timing: WriterTuning = FAST) -> Store:
        store = Store.open(Target(dsn=dsn), retention_days, timing)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def test_the_schema_is_sqlites(postgres: Cluster, stores: Any, tmp_path: Path) -> None:
    dsn = postgres.database()
    assert stores(dsn).available
    lite = open_sqlite(tmp_path / "r.sqlite3")
    schema.migrate(lite)
    pg = open_postgres(dsn)
    for table in ("generations", "daily_totals", "schema_version"):
        names = [r[1] for r in lite.query(f"PRAGMA table_info({table})")]
        found = pg.query(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
            "ORDER BY ordinal_position",
            (table,),
        )
        assert [r[0] for r in found] == names, table
    assert pg.query("SELECT version FROM schema_version") == [(schema.VERSION,)]
    pg.close()
    lite.close()


def test_a_record_of_version_2_gains_the_machine_column_null_in_its_rows(
    postgres: Cluster, stores: Any
) -> None:
    dsn = postgres.database()
    db = open_postgres(dsn)
    at_version_2(db)
    store = stores(dsn)
    assert store.available
    assert store.record(row(prompt=2, machine="spark-1")) and store.record(row(prompt=3))
    store.close()
    found = db.query("SELECT prompt_tokens, machine FROM generations ORDER BY prompt_tokens")
    assert found == [(1, None), (2, "spark-1"), (3, None)]
    assert db.query("SELECT version FROM schema_version") == [(schema.VERSION,)]
    db.close()


def test_rows_and_totals_are_committed_together(postgres: Cluster, stores: Any) -> None:
    dsn = postgres.database()
    store = stores(dsn)
    assert all(store.record(row(key_id=KEY if n % 2 else OTHER, prompt=n)) for n in range(1200))
    store.close()
    db = open_postgres(dsn)
    found = facts(db)
    assert found.ids == list(range(1200)) and found.totals_match
    assert batch.key_total(db, KEY, datetime.now(UTC).date()) == (
        sum(range(1, 1200, 2)) + 600 * 20,
        600,
    )
    db.close()


def test_gateways_starting_at_once_migrate_once(postgres: Cluster, stores: Any) -> None:
    dsn = postgres.database()
    ready = threading.Barrier(4)
    opened: list[Store] = []

    def open_one() -> None:
        ready.wait()
        opened.append(stores(dsn))

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [store.reason for store in opened] == [None] * 4
    db = open_postgres(dsn)
    assert db.query("SELECT version FROM schema_version") == [(schema.VERSION,)]
    db.close()


def test_two_gateways_share_one_record_and_one_budget(postgres: Cluster, stores: Any) -> None:
    dsn = postgres.database()
    one, two = stores(dsn), stores(dsn)
    for _ in range(3):
        one.record(row(prompt=100, completion=0))
    for _ in range(2):
        two.record(row(prompt=10, completion=0))
    both = Spent(320, 5)
    until(lambda: one.spending(KEY) == both, what="the first gateway seeing the second's rows")
    until(lambda: two.spending(KEY) == both, what="the second gateway seeing the first's rows")
    db = open_postgres(dsn)
    assert facts(db).totals_match
    db.close()


def test_a_name_outside_the_rule_is_kept_by_its_digest_charged_and_reported(
    postgres: Cluster, stores: Any
) -> None:
    """The gateway's row for a model a library held before the served-name rule: kept, its
    tokens in its key's total, the usage naming it by the digest form (was: refused)."""
    dsn = postgres.database()
    store = stores(dsn)
    legacy = "Qwen 7B (Q4)"
    usage = {"prompt_tokens": 5, "completion_tokens": 3}
    for _ in range(2):
        made = row_of(
            Trace(arrived=0.0, outcome="ok", usage=usage),
            Request(KEY, legacy, legacy, "small"),
            now=1.0,
        )
        assert store.record(made)
    until(lambda: store.committed == 2, what="the rows committed")
    assert store.spending(KEY) == Spent(16, 2)
    db = open_postgres(dsn)
    (line,) = queries.usage(db, days_ago(1), "model")
    assert line.group == (digest_form(legacy),) and line.group[0].startswith("Qwen_7B__Q4_~")
    assert (line.requests, line.prompt_tokens, line.completion_tokens) == (2, 10, 6)
    db.close()


def test_a_bad_dsn_is_unavailable_and_shows_no_password(stores: Any) -> None:
    port = free_port()  # nothing listens there: the reason must be that, not any failure
    dsn = f"postgresql://lucia:hunter2-secret@127.0.0.1:{port}/nothing"
    with structlog.testing.capture_logs() as logs:
        store = stores(dsn)
        assert not store.available
        assert f'connection to server at "127.0.0.1", port {port} failed: Connection refused' in (
            str(store.reason)
        ), store.reason
        assert not store.record(row())
        assert store.spending(KEY) is None
    assert "hunter2" not in str(store.reason) and "hunter2" not in repr(logs)
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == [UNAVAILABLE]


def test_postgresql_stopped_mid_load_loses_nothing_promised_and_recovers(
    postgres: Cluster, stores: Any
) -> None:
    dsn = postgres.database()
    with structlog.testing.capture_logs() as logs:
        store = stores(dsn)
        answered: dict[int, float] = {}
        stop = threading.Event()

        def load() -> None:
            number = 0
            while not stop.is_set():
                if store.record(row(prompt=number)):
                    answered[number] = time.monotonic()
                number += 1
                time.sleep(0.001)

        loader = threading.Thread(target=load)
        loader.start()
        try:
            until(lambda: len(answered) > 300, what="rows under load")
            until(  # rows enough that were promised before the stop: the load may be slow
                lambda: (
                    sum(
                        at < time.monotonic() - COMMITTED_WITHIN_S
                        for at in answered.copy().values()
                    )
                    > 100
                ),
                what="rows promised before the stop",
            )
            stopping = time.monotonic()
            postgres.stop()
            until(lambda: not store.available, what="the store seeing PostgreSQL gone")
            assert not store.record(row())
            assert store.spending(KEY) is None
            postgres.start()
            until(lambda: store.available, what="the recovery")
            after = len(answered)
            until(lambda: len(answered) > after + 100, what="rows after the recovery")
        finally:
            stop.set()
            loader.join(30)
            if not postgres.running():
                postgres.start()
        store.close()
    assert store.dropped.get("unavailable", 0) > 0
    promised = {n for n, at in answered.items() if at < stopping - COMMITTED_WITHIN_S}
    db = open_postgres(dsn)
    found = facts(db)
    db.close()
    assert len(promised) > 100
    assert sorted(promised - set(found.ids)) == []
    assert max(found.ids) > max(promised)  # rows recorded after the recovery are there
    assert found.totals_match
    events = [e["event"] for e in logs]
    assert events.count(UNAVAILABLE) == 1
    assert events.count("record available again") == 1


def test_a_frozen_postgresql_never_blocks_a_caller(postgres: Cluster, stores: Any) -> None:
    """A server that neither fails nor answers (SIGSTOP): the writer's call hangs, the callers
    do not; after stall_s the store is unavailable, until the call returns."""
    dsn = postgres.database()
    timing = WriterTuning(stall_s=1.0, queue_rows=200, backoff_s=0.05, backoff_max_s=0.5)
    with structlog.testing.capture_logs() as logs:
        store = stores(dsn, timing=timing)
        until(lambda: store.spending(KEY) is not None, what="today's totals read")
        postgres.freeze()
        try:
            until(
                lambda: (
                    within(10, lambda: [store.record(row()) for _ in range(20)])
                    and not store.available
                ),
                what="the stall seen",
            )
            assert "not answered" in str(store.reason)
            assert store.spending(KEY) is None
            assert within(10, lambda: [store.record(row()) for _ in range(500)]) == [False] * 500
        finally:
            postgres.thaw()
        until(lambda: store.available, what="the answer after the thaw")
        assert store.record(row())
        until(lambda: store.committed > 0 and store.queued == 0, what="the commits after it")
    events = [e["event"] for e in logs]
    assert events.count(UNAVAILABLE) == 1
    assert events.count("record available again") == 1
    assert store.dropped["unavailable"] >= 500


@pytest.mark.alone  # a bound in time on a machine of two cores: nothing runs beside it
def test_after_a_sigkill_mid_load_every_row_answered_before_the_bound_is_there(
    postgres: Cluster, tmp_path: Path
) -> None:
    dsn = postgres.database()
    run = run_and_kill(Target(dsn=dsn), rows=5000, log=tmp_path / "child.log")
    promised = {n for n, at in run.answered.items() if at < run.killed_at - COMMITTED_WITHIN_S}
    assert len(promised) > 1000, run.log[-2000:]
    db = open_postgres(dsn)
    found = facts(db)
    db.close()
    assert sorted(promised - set(found.ids)) == []
    assert found.totals_match
    assert len(found.ids) == len(set(found.ids))


def test_old_rows_are_pruned_in_batches(postgres: Cluster, stores: Any) -> None:
    dsn = postgres.database()
    writer = stores(dsn)
    for n in range(30):
        writer.record(row(days_ago(10 + n / 10), prompt=n))
    writer.record(row(prompt=1000))
    writer.close()
    store = stores(dsn, retention_days=7, timing=WriterTuning(prune_rows=4, backoff_s=0.05))
    db = open_postgres(dsn)
    until(lambda: facts(db).ids == [1000], what="the prune")
    store.close()
    assert db.query(
        "SELECT COUNT(*) FROM daily_totals WHERE day < ?", (days_ago(7).date().isoformat(),)
    ) == [(0,)]
    db.close()


def test_usage_is_the_same_on_both_and_its_percentiles_are_percentile_conts(
    postgres: Cluster, tmp_path: Path
) -> None:
    start = datetime.now(UTC) - timedelta(hours=2)
    made = [
        row(
            start + timedelta(seconds=n),
            key_id=KEY if n % 3 else OTHER,
            build=Build("0.32.0", "sha256:" + "12" * 32, "abc") if n % 2 else Build(),
            outcome="ok" if n % 7 else refused("rate_limited"),
            prompt=n,
            completion=n % 13,
            ttft_s=(n * 37 % 101) / 100 if n % 7 else None,
        )
        for n in range(500)
    ]
    pg = open_postgres(postgres.database())
    lite = open_sqlite(tmp_path / "r.sqlite3")
    for db in (pg, lite):
        schema.migrate(db)
        batch.write(db, made)
    for by in queries.GROUPS:
        on_pg = queries.usage(pg, start, by)  # type: ignore[arg-type]
        on_lite = queries.usage(lite, start, by)  # type: ignore[arg-type]
        assert on_pg == on_lite, by
    cont = pg.query(
        "SELECT key_id, percentile_cont(0.5) WITHIN GROUP (ORDER BY ttft_s), "
        "percentile_cont(0.95) WITHIN GROUP (ORDER BY ttft_s) FROM generations "
        "WHERE ttft_s IS NOT NULL GROUP BY key_id"
    )
    lines = {line.group[0]: line for line in queries.usage(pg, start, "key")}
    for key, p50, p95 in cont:
        assert (lines[key].ttft_p50, lines[key].ttft_p95) == (
            pytest.approx(p50),
            pytest.approx(p95),
        )
    pg.close()
    lite.close()
