"""The record on real SQLite files: what is written and how, budgets, retention, a full disk, a
read-only place, a SIGKILL mid-load, the usage command, and no text anywhere."""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import stat
import subprocess
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

from supervisor import cli
from supervisor.host.record import batch, queries, schema
from supervisor.host.record.database import Target, open_reader, open_sqlite
from supervisor.host.record.ledger import Spent
from supervisor.host.record.row import Build, Row, RowRefused, refused, tokens_of
from supervisor.host.record.store import Store
from supervisor.host.record.writer import COMMITTED_WITHIN_S, WriterTuning
from supervisor.protocol.documents import RunningEngine
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

FAST = WriterTuning(backoff_s=0.05, backoff_max_s=0.5)


def rows_in(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM generations").fetchone()[0])


@pytest.fixture
def store_at(tmp_path: Path) -> Iterator[Any]:
    opened: list[Store] = []

    def make(
        path: Path | None = None, retention_days: int = 0, timing: WriterTuning = FAST
    ) -> Store:
        store = Store.open(
            Target(path=path or tmp_path / "record" / "record.sqlite3"), retention_days, timing
        )
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def test_the_file_is_private_wal_and_versioned(tmp_path: Path, store_at: Any) -> None:
    path = tmp_path / "data" / "record" / "record.sqlite3"
    store = store_at(path)
    assert store.available and store.reason is None
    assert store.record(row())
    store.close()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    files = sorted(p.name for p in path.parent.iterdir())
    assert files[0] == "record.sqlite3"
    for name in files:
        assert stat.S_IMODE((path.parent / name).stat().st_mode) == 0o600, name
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(schema.VERSION,)]


def test_a_file_left_readable_by_others_is_made_private(tmp_path: Path, store_at: Any) -> None:
    path = tmp_path / "record.sqlite3"
    path.touch(mode=0o644)
    os.chmod(path, 0o644)
    assert store_at(path).available
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_reopening_migrates_nothing_and_keeps_the_rows(tmp_path: Path, store_at: Any) -> None:
    path = tmp_path / "r.sqlite3"
    first = store_at(path)
    first.record(row())
    first.close()
    with structlog.testing.capture_logs() as logs:
        store_at(path).close()
    opened = [e for e in logs if e["event"] == "record opened"]
    assert opened[0]["migrated_from"] == schema.VERSION
    assert rows_in(path) == 1


def test_a_schema_from_a_newer_version_is_not_written_to(tmp_path: Path, store_at: Any) -> None:
    path = tmp_path / "r.sqlite3"
    store_at(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (schema.VERSION + 1,))
    store = store_at(path)
    assert not store.available
    assert f"version {schema.VERSION + 1}" in str(store.reason)
    assert not store.record(row())
    assert rows_in(path) == 0


def test_a_record_of_version_2_gains_the_machine_column_null_in_its_rows(
    tmp_path: Path, store_at: Any
) -> None:
    path = tmp_path / "r.sqlite3"
    db = open_sqlite(path)
    at_version_2(db)
    db.close()
    store = store_at(path)
    assert store.available
    assert store.record(row(prompt=2, machine="spark-1")) and store.record(row(prompt=3))
    store.close()
    db = open_sqlite(path)
    found = db.query("SELECT prompt_tokens, machine FROM generations ORDER BY prompt_tokens")
    assert found == [(1, None), (2, "spark-1"), (3, None)]
    assert db.query("SELECT version FROM schema_version") == [(schema.VERSION,)]
    db.close()


def test_rows_and_totals_are_committed_together(tmp_path: Path, store_at: Any) -> None:
    path = tmp_path / "r.sqlite3"
    store = store_at(path)
    made = [row(key_id=KEY if n % 2 else OTHER, prompt=n, completion=1) for n in range(1200)]
    assert all(store.record(r) for r in made)
    store.close()
    db = open_sqlite(path)
    found = facts(db)
    assert found.ids == list(range(1200)) and found.totals_match
    today = datetime.now(UTC).date()
    assert batch.key_total(db, KEY, today) == (sum(range(1, 1200, 2)) + 600, 600)
    db.close()


def test_spent_counts_what_is_queued_before_it_is_committed(store_at: Any) -> None:
    slow = WriterTuning(flush_s=3600.0, batch_rows=10_000, backoff_s=0.05)
    store = store_at(timing=slow)
    until(lambda: store.spending(KEY) is not None, what="today's totals read")
    assert store.spending(KEY) == Spent(0, 0)
    for _ in range(3):
        store.record(row(prompt=100, completion=50))
    assert store.spending(KEY) == Spent(450, 3)
    assert store.committed == 0  # nothing committed yet: the burst is counted all the same
    assert store.spending(OTHER) == Spent(0, 0)


def test_the_gateways_budget_reads_the_store(store_at: Any) -> None:
    """proxy.budget's standing and refusal, with the store as its Spending."""
    from supervisor.host.keycheck import Identity
    from supervisor.host.proxy import budget as budgets

    caller = Identity(KEY, "inference", "laptop", budget=1000)
    store = store_at(timing=WriterTuning(flush_s=3600.0, batch_rows=10_000, backoff_s=0.05))
    spending: budgets.Spending = store
    now = datetime.now(UTC)
    assert budgets.standing(caller, 0, spending, now).spent == 0
    for _ in range(3):
        store.record(row(prompt=300, completion=40))  # queued: none committed yet
    stand = budgets.standing(caller, 0, spending, now)
    assert (stand.spent, stand.enforced, stand.over) == (1020, True, True)
    assert budgets.refusal(stand, now).status == 429
    store.close()
    assert not budgets.standing(caller, 0, spending, now).enforced  # closed: nothing enforced


def test_spent_includes_what_another_writer_committed(tmp_path: Path, store_at: Any) -> None:
    path = tmp_path / "r.sqlite3"
    other = store_at(path)
    other.record(row(prompt=7, completion=3))
    other.close()
    store = store_at(path)
    assert until(lambda: store.spending(KEY)) == Spent(10, 1)
    store.record(row(prompt=1, completion=1))
    assert store.spending(KEY) == Spent(12, 2)
    until(lambda: store.committed == 1)
    assert store.spending(KEY) == Spent(12, 2)


def test_old_rows_and_their_days_totals_are_pruned_in_batches(
    tmp_path: Path, store_at: Any
) -> None:
    path = tmp_path / "r.sqlite3"
    writer = store_at(path)
    for n in range(50):
        writer.record(row(days_ago(40 + n / 10), prompt=n))
    for n in range(5):
        writer.record(row(days_ago(n), prompt=1000 + n))
    writer.close()
    with structlog.testing.capture_logs() as logs:
        store = store_at(path, retention_days=30, timing=WriterTuning(prune_rows=7, backoff_s=0.05))
        until(lambda: rows_in(path) == 5, what="the prune")
        store.close()
    pruned = [(e["rows"], e["batches"]) for e in logs if e["event"] == "record pruned"]
    assert len(pruned) == 1 and pruned[0][0] == 50 and pruned[0][1] >= 50 // 7
    db = open_sqlite(path)
    assert facts(db).ids == [1000, 1001, 1002, 1003, 1004]
    cutoff = days_ago(30).date().isoformat()
    assert db.query("SELECT COUNT(*) FROM daily_totals WHERE day < ?", (cutoff,)) == [(0,)]
    db.close()


def _mount_tmpfs(where: Path, size: str, read_only: bool = False) -> None:
    where.mkdir(exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], check=True)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    where = tmp_path / "small"
    _mount_tmpfs(where, "256k")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _remount(where: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(where)], check=True)


def _fill(store: Any) -> None:
    """Record rows 200 at a time, each batch committed or failed, until the store is
    unavailable (its disk full)."""
    number = 0
    while store.available:
        for n in range(200):
            store.record(row(prompt=number + n))  # never raises, whatever the disk says
        number += 200
        until(lambda: store.queued == 0 or not store.available, what="a commit or a failure")


def test_a_full_disk_makes_the_store_unavailable_until_there_is_room(
    tmpfs: Path, store_at: Any
) -> None:
    path = tmpfs / "record.sqlite3"
    with structlog.testing.capture_logs() as logs:
        store = store_at(path)
        assert store.available
        _fill(store)
        assert any(word in str(store.reason) for word in ("full", "No space", "I/O")), store.reason
        assert not store.record(row())
        assert sum(store.dropped.values()) > 0
        _remount(tmpfs, "size=16m")
        until(lambda: store.available, what="the recovery")
        assert store.record(row(prompt=10**9))
        store.close()
    events = [e["event"] for e in logs if e["event"].startswith("record ")]
    # each loss said once, each recovery once: while the disk is nearly full a write may pass
    # again (SQLite frees pages), so the store may go and come back more than once on the way
    down, up = (
        "record unavailable: rows are not recorded and budgets not enforced",
        "record available again",
    )
    changes = [event for event in events if event in (down, up)]
    assert changes and changes[0] == down and changes[-1] == up, events
    assert all(a != b for a, b in itertools.pairwise(changes)), events
    db = open_sqlite(path)
    assert db.query("PRAGMA integrity_check") == [("ok",)]
    found = facts(db)
    # what the writer committed is there, and nothing else
    assert found.totals_match and len(found.ids) == store.committed and 10**9 in found.ids
    db.close()


@pytest.fixture
def loop_disk(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A small ext4 file system on a loop device, almost filled by one file: (its mount point,
    the filler, whose removal is the operator freeing space)."""
    if os.geteuid() != 0:
        pytest.skip("a loop device needs root (CI runs as root)")
    image, where = tmp_path / "disk.img", tmp_path / "disk"
    with image.open("wb") as handle:
        handle.truncate(8 * 2**20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    device = subprocess.run(
        ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    where.mkdir()
    try:
        subprocess.run(["mount", device, str(where)], check=True)
        filler = where / "filler"
        free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
        subprocess.run(["fallocate", "-l", str(free - 384 * 1024), str(filler)], check=True)
        yield where, filler
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        subprocess.run(["losetup", "-d", device], check=False)


def test_a_full_loop_device_makes_the_store_unavailable_until_space_is_freed(
    loop_disk: tuple[Path, Path], store_at: Any
) -> None:
    where, filler = loop_disk
    path = where / "record.sqlite3"
    with structlog.testing.capture_logs() as logs:
        store = store_at(path)
        assert store.available
        _fill(store)
        assert "No space" in str(store.reason) or "full" in str(store.reason), store.reason
        committed = store.committed
        filler.unlink()  # the operator frees space
        until(lambda: store.available, what="the recovery")
        assert store.record(row(prompt=10**9))
        store.close()
    events = [e["event"] for e in logs if e["event"].startswith("record ")]
    assert events.count("record available again") == 1
    db = open_sqlite(path)
    assert db.query("PRAGMA integrity_check") == [("ok",)]
    found = facts(db)
    db.close()
    # every row committed before the disk filled is there, and the one after recovery
    assert len(found.ids) == store.committed and committed <= len(found.ids)
    assert 10**9 in found.ids and found.totals_match


def test_a_read_only_place_makes_the_store_unavailable_until_it_is_writable(
    tmpfs: Path, store_at: Any
) -> None:
    _remount(tmpfs, "ro")
    with structlog.testing.capture_logs() as logs:
        store = store_at(tmpfs / "record" / "record.sqlite3")
        assert not store.available and "Read-only file system" in str(store.reason)
        for _ in range(5):
            assert store.record(row()) is False
        assert store.dropped == {"unavailable": 5}
        assert store.spending(KEY) is None  # no budget is known, so none can be enforced
        _remount(tmpfs, "rw")
        until(lambda: store.available, what="the recovery")
        assert store.record(row())
        until(lambda: store.committed == 1)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "Read-only" in warnings[0]["reason"]


def test_a_stop_interrupts_the_back_off(tmp_path: Path) -> None:
    (tmp_path / "a-file").touch()
    store = Store.open(
        Target(path=tmp_path / "a-file" / "r.sqlite3"),
        0,
        WriterTuning(backoff_s=3600.0, backoff_max_s=3600.0),
    )
    assert not store.available and "FileExistsError" in str(store.reason)
    store.close(timeout_s=30)
    assert not store._writer.is_alive()


def test_an_unexpected_error_in_the_writer_is_said_and_survived(tmp_path: Path) -> None:
    calls = itertools.count()

    def now() -> datetime:  # the writer asks at each refresh of today's totals
        if next(calls) == 3:
            raise RuntimeError("an error nobody expected")
        return datetime.now(UTC)

    timing = WriterTuning(refresh_s=0.01, backoff_s=0.05)
    with structlog.testing.capture_logs() as logs:
        store = Store.open(Target(path=tmp_path / "r.sqlite3"), 0, timing, now=now)
        until(lambda: any(e["event"] == "record writer: an unexpected error" for e in logs))
        # a row recorded between the error and its handling would be dropped with the queue
        until(lambda: any(e["event"] == "record available again" for e in logs))
        until(lambda: store.available, what="the writer going on")
        assert store.record(row())
        until(lambda: store.committed == 1, what="the row committed")
        store.close()


@pytest.mark.alone  # a bound in time on a machine of two cores: nothing runs beside it
def test_after_a_sigkill_mid_load_every_row_answered_before_the_bound_is_there(
    tmp_path: Path,
) -> None:
    path = tmp_path / "record.sqlite3"
    run = run_and_kill(Target(path=path), rows=5000, log=tmp_path / "child.log")
    promised = {n for n, at in run.answered.items() if at < run.killed_at - COMMITTED_WITHIN_S}
    assert len(promised) > 1000, run.log[-2000:]
    db = open_sqlite(path)
    assert db.query("PRAGMA integrity_check") == [("ok",)]
    found = facts(db)
    db.close()
    assert sorted(promised - set(found.ids)) == []
    assert found.totals_match
    assert len(found.ids) == len(set(found.ids))


# -- reading it ------------------------------------------------------------------------------------


def _filled(path: Path) -> list[Row]:
    hour = datetime.now(UTC) - timedelta(hours=1)
    rng = np.random.default_rng(7)
    made = []
    for n in range(400):
        outcome = "ok" if n % 10 else refused("rate_limited" if n % 20 else "budget_exceeded")
        made.append(
            row(
                hour + timedelta(seconds=n),
                key_id=KEY if n % 3 else OTHER,
                model="m1" if n % 2 else "m2",
                build=Build("0.32.0", "sha256:" + "cd" * 32, "e5a1f00d") if n % 4 else Build(),
                outcome=outcome,
                prompt=n,
                completion=2 * n,
                cached=n // 2,
                ttft_s=float(rng.exponential(0.2)) if outcome == "ok" else None,
            )
        )
    made.append(row(days_ago(3), prompt=99))  # before --since
    db = open_sqlite(path)
    schema.migrate(db)
    batch.write(db, made)
    db.close()
    return made


@pytest.mark.parametrize("by", ["key", "model", "engine", "build"])
def test_usage_counts_and_percentiles_match_the_rows(tmp_path: Path, by: str) -> None:
    path = tmp_path / "r.sqlite3"
    made = [r for r in _filled(path) if r.at > days_ago(1)]
    column = {"key": "key_id", "model": "model", "engine": "engine"}
    db = open_reader(Target(path=path))
    lines = queries.usage(db, days_ago(1), by)  # type: ignore[arg-type]
    db.close()
    for line in lines:
        if by == "build":
            mine = [
                r
                for r in made
                if (r.engine, r.build.engine_version, r.build.image_id, r.build.weights_revision)
                == line.group
            ]
        else:
            mine = [r for r in made if getattr(r, column[by]) == line.group[0]]
        assert line.requests == len(mine)
        assert line.prompt_tokens == sum(r.prompt_tokens or 0 for r in mine)
        assert line.completion_tokens == sum(r.completion_tokens or 0 for r in mine)
        assert line.cached_tokens == sum(r.cached_tokens or 0 for r in mine)
        times = sorted(r.ttft_s for r in mine if r.ttft_s is not None)
        assert line.ttft_p50 == pytest.approx(float(np.percentile(times, 50)))
        assert line.ttft_p95 == pytest.approx(float(np.percentile(times, 95)))
        assert sum(line.refusals.values()) == sum(r.outcome.startswith("refused:") for r in mine)
    assert sum(line.requests for line in lines) == 400


def test_the_usage_command_prints_the_build_and_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    _filled(data / "record" / "record.sqlite3")
    settings = tmp_path / "gw.toml"
    settings.write_text("")
    assert (
        cli.main(["usage", "--by", "build", "--data-dir", str(data), "--settings", str(settings)])
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["ENGINE", "VERSION", "IMAGE", "WEIGHTS"]
    assert out[1].split()[:6] == ["e1", "0.32.0", "sha256:cdcdcdcdcdcd", "e5a1f00d", "300", "280"]
    assert out[2].split()[:5] == ["e1", "unknown", "unknown", "unknown", "100"]
    assert (
        cli.main(
            [
                "usage",
                "--json",
                "--since",
                "2w",
                "--data-dir",
                str(data),
                "--settings",
                str(settings),
            ]
        )
        == 0
    )
    document = json.loads(capsys.readouterr().out)
    assert sum(group["requests"] for group in document["groups"]) == 401
    assert {group["keyId"] for group in document["groups"]} == {KEY, OTHER}


def test_the_usage_command_without_a_record_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = tmp_path / "gw.toml"
    settings.write_text("")
    code = cli.main(["usage", "--data-dir", str(tmp_path), "--settings", str(settings)])
    assert code == 1
    assert "nothing recorded yet" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [settings]  # the reader made no file


# -- no text -------------------------------------------------------------------------------------


def test_no_prompt_text_reaches_the_file_or_the_logs(tmp_path: Path, store_at: Any) -> None:
    """What a request's text could reach on its way to a row: the engine's usage (extra
    fields), the status's build, a refusal's message. None of it is kept."""
    unique = f"zq-unique-{uuid.uuid4().hex}"
    prompt = f"Please remember {unique} forever"
    path = tmp_path / "record" / "record.sqlite3"
    with structlog.testing.capture_logs() as logs:
        store = store_at(path)
        usage = {
            "prompt_tokens": 9,
            "completion_tokens": 4,
            "echo": prompt,
            "prompt_tokens_details": {"cached_tokens": 2, "text": prompt},
        }
        engine = RunningEngine.model_validate(
            {
                "image": unique,
                "imageId": "sha256:" + "ef" * 32,
                "containerId": unique,
                "model": unique,
                "engineVersion": prompt,
            }
        )
        prompt_tokens, completion_tokens, cached = tokens_of(usage)
        for outcome in ("ok", refused("rate_limited"), "engine_error"):
            store.record(
                row(
                    build=Build.of(engine),
                    outcome=outcome,
                    prompt=prompt_tokens,
                    completion=completion_tokens,
                    cached=cached,
                )
            )
        for field in ("model", "engine"):
            with pytest.raises(RowRefused):
                row(**{field: prompt})
        until(lambda: store.committed == 3)
        store.close()
    stored = b"".join(p.read_bytes() for p in path.parent.iterdir())
    assert b"sha256:" + b"ef" * 32 in stored  # the build is there: the grep reads the rows
    assert unique.encode() not in stored
    assert unique not in repr(logs)
