"""The record's figures on the page, on real SQLite files: the hourly times to first token per
build, each key's last use, the traffic section, its cache, and a record that cannot be read."""

from __future__ import annotations

import json
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from supervisor.host import keys
from supervisor.host.page.traffic import Cached, KeyUse, Traffic, traffic_of
from supervisor.host.record import batch, queries, schema
from supervisor.host.record.database import Target, open_reader, open_sqlite
from supervisor.host.record.ledger import Spent
from supervisor.host.record.row import Build, Row, refused
from tests.record_world import KEY, OTHER, row

NEW = Build("0.33.0", "sha256:" + "ab" * 32, "e5a1f00d")
OLD = Build("0.32.0", "sha256:" + "cd" * 32, "e5a1f00d")
NOW = datetime.now(UTC).replace(minute=30, second=0, microsecond=0)


def written(path: Path, rows: list[Row]) -> Target:
    db = open_sqlite(path)
    schema.migrate(db)
    batch.write(db, rows)
    db.close()
    return Target(path=path)


def _build_change() -> list[Row]:
    """Six hours on the old build, then three on the new one, which is twice as fast."""
    made = []
    rng = np.random.default_rng(3)
    for hour in range(9, 0, -1):
        start = NOW.replace(minute=0) - timedelta(hours=hour)
        build, scale = (OLD, 0.4) if hour > 3 else (NEW, 0.2)
        for n in range(20):
            made.append(
                row(
                    start + timedelta(minutes=2 * n),
                    build=build,
                    ttft_s=float(rng.exponential(scale)),
                )
            )
    return made


def test_hourly_gives_each_builds_percentiles_per_hour(tmp_path: Path) -> None:
    made = _build_change()
    made.append(row(NOW - timedelta(days=2), build=OLD, ttft_s=99.0))  # before since
    made.append(
        row(NOW - timedelta(hours=2), build=NEW, outcome=refused("rate_limited"), ttft_s=None)
    )
    target = written(tmp_path / "r.sqlite3", made)
    db = open_reader(target)
    found = queries.hourly(db, NOW - timedelta(days=1), "build")
    db.close()
    assert [start for start, _ in found] == sorted(start for start, _ in found)
    assert len(found) == 9
    for start, line in found:
        mine = [
            r
            for r in made
            if r.at >= start
            and r.at < start + timedelta(hours=1)
            and (r.engine, r.build.engine_version, r.build.image_id, r.build.weights_revision)
            == line.group
        ]
        assert start.minute == 0 and start.tzinfo is not None
        assert line.requests == len(mine)
        times = sorted(r.ttft_s for r in mine if r.ttft_s is not None)
        assert line.timed == len(times)
        assert line.ttft_p50 == pytest.approx(float(np.percentile(times, 50)))
        assert line.ttft_p95 == pytest.approx(float(np.percentile(times, 95)))
        assert line.group[1] == ("0.32.0" if start < NOW - timedelta(hours=4) else "0.33.0")


def test_last_use_is_each_keys_latest_row(tmp_path: Path) -> None:
    latest = NOW - timedelta(minutes=5, microseconds=7)
    target = written(
        tmp_path / "r.sqlite3",
        [
            row(NOW - timedelta(hours=3)),
            row(latest),
            row(NOW - timedelta(hours=1), key_id=OTHER),
            row(NOW - timedelta(days=9), key_id="key_000000000000"),
        ],
    )
    db = open_reader(target)
    found = queries.last_use(db, NOW - timedelta(days=7))
    db.close()
    assert found == {KEY: latest, OTHER: NOW - timedelta(hours=1)}


def test_the_traffic_section_counts_refusals_and_charts_each_build(tmp_path: Path) -> None:
    made = [
        *_build_change(),
        row(
            NOW - timedelta(minutes=10), outcome=refused("budget_exceeded"), ttft_s=None, model="m2"
        ),
    ]
    data = traffic_of(written(tmp_path / "r.sqlite3", made), NOW)
    json.dumps(data)  # JSON-ready
    assert data["day"]["requests"] == len(made)
    assert data["day"]["refusals"] == {"budget_exceeded": 1}
    assert data["hour"]["requests"] == sum(r.at >= NOW - timedelta(hours=1) for r in made)
    assert {g["model"] for g in data["day"]["byModel"]} == {"m1", "m2"}
    versions = [series["engineVersion"] for series in data["chart"]["builds"]]
    assert sorted(versions) == ["0.32.0", "0.33.0"]
    for series in data["chart"]["builds"]:
        assert len(series["points"]) == (6 if series["engineVersion"] == "0.32.0" else 3)
        assert all(point["p50"] > 0 and point["n"] == 20 for point in series["points"])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_cache_reads_once_per_max_age() -> None:
    reads: list[int] = []
    clock = Clock()
    cached = Cached(lambda: {"n": len(reads.append(1) or reads)}, 5.0, clock)
    assert cached.get() == {"n": 1}
    clock.now += 4.9
    assert cached.get() == {"n": 1}
    clock.now += 0.1
    assert cached.get() == {"n": 2}


def test_a_record_that_cannot_be_read_says_why(tmp_path: Path) -> None:
    path = tmp_path / "r.sqlite3"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE other (x INTEGER)")
    answer = Traffic(Target(path=path)).read()
    assert answer is not None and answer["problem"].startswith("the record cannot be read")


def test_key_use_is_the_last_use_and_the_days_spending_against_the_budget(
    tmp_path: Path,
) -> None:
    keys_file = tmp_path / "keys.json"
    alice = keys.create(keys_file, "alice", NOW, None).entry.id
    bob = keys.create(keys_file, "bob", NOW, None).entry.id
    keys.set_budget(keys_file, alice, 5000)
    target = written(tmp_path / "r.sqlite3", [row(NOW - timedelta(minutes=5), key_id=alice)])

    class PageSpending:
        def spending(self, key_id: str) -> Spent | None:
            return Spent(1234, 5) if key_id == alice else None

    use = KeyUse(target, PageSpending(), keys_file, 100_000).read()
    assert use is not None
    when = (NOW - timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
    assert use[alice] == {
        "lastUse": when,
        "lastUseKnown": True,
        "spentTokens": 1234,
        "spentRequests": 5,
        "budget": 5000,
        "exempt": False,
    }
    assert use[bob]["lastUse"] is None and use[bob]["budget"] == 100_000
    assert use[bob]["spentTokens"] is None
    assert KeyUse(target, None, keys_file, 0).read()[bob]["budget"] is None  # type: ignore[index]
