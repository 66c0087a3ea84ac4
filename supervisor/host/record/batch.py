"""What the writer runs: a batch of rows with its totals, a day's totals, a probe, pruning.

A batch's rows and the per-key, per-day totals they add go in one transaction: after any crash
the totals are exactly the sums of the rows that are there. The totals are added in one order
(day, then key), so two gateways writing to one PostgreSQL never wait on each other in a
circle.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import date
from typing import Final

from supervisor.host.record.database import Database
from supervisor.host.record.row import Row, epoch_us

COLUMNS: Final = (
    "at_us",
    "key_id",
    "model",
    "engine",
    "engine_version",
    "image_id",
    "weights_revision",
    "outcome",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "wait_s",
    "ttft_s",
    "duration_s",
    "usage_source",
    "machine",
)
ADD_TOTAL: Final = (
    "INSERT INTO daily_totals (day, key_id, tokens, requests) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (day, key_id) DO UPDATE SET tokens = daily_totals.tokens + excluded.tokens, "
    "requests = daily_totals.requests + excluded.requests"
)

Totals = dict[tuple[str, str], tuple[int, int]]  # (day, key id) -> (tokens, requests)


def values(row: Row) -> tuple[object, ...]:
    """Pure: a row's column values, in COLUMNS' order."""
    build = row.build
    return (
        epoch_us(row.at),
        row.key_id,
        row.model,
        row.engine,
        build.engine_version,
        build.image_id,
        build.weights_revision,
        row.outcome,
        row.prompt_tokens,
        row.completion_tokens,
        row.cached_tokens,
        row.wait_s,
        row.ttft_s,
        row.duration_s,
        row.usage_source,
        row.machine,
    )


def totals_of(rows: Iterable[Row]) -> Totals:
    """Pure: what rows add to each (day, key): tokens and requests, in (day, key) order."""
    found: dict[tuple[str, str], list[int]] = {}
    for row in rows:
        entry = found.setdefault((row.day.isoformat(), row.key_id), [0, 0])
        entry[0] += row.tokens
        entry[1] += 1
    return {key: (tokens, requests) for key, (tokens, requests) in sorted(found.items())}


def write(db: Database, rows: Sequence[Row]) -> None:
    """The rows and their totals, committed together."""
    totals = totals_of(rows)
    with db.transaction():
        db.bulk("generations", COLUMNS, [values(row) for row in rows])
        db.executemany(ADD_TOTAL, [(*key, *added) for key, added in totals.items()])


def day_totals(db: Database, day: date) -> dict[str, tuple[int, int]]:
    """Each key's (tokens, requests) on a UTC day: one range of the primary key."""
    found = db.query(
        "SELECT key_id, tokens, requests FROM daily_totals WHERE day = ?", (day.isoformat(),)
    )
    return {str(key): (int(tokens), int(requests)) for key, tokens, requests in found}


def key_total(db: Database, key_id: str, day: date) -> tuple[int, int]:
    """One key's (tokens, requests) on a UTC day: one primary-key lookup."""
    found = db.query(
        "SELECT tokens, requests FROM daily_totals WHERE day = ? AND key_id = ?",
        (day.isoformat(), key_id),
    )
    return (int(found[0][0]), int(found[0][1])) if found else (0, 0)


def probe(db: Database) -> None:
    """A write that changes nothing: does the database take writes now (a full disk)?"""
    with db.transaction():
        db.execute("UPDATE schema_version SET version = version")


def prune_step(db: Database, before_us: int, before_day: date, limit: int) -> tuple[int, bool]:
    """Delete about `limit` of the oldest rows older than `before_us` (all the rows of the
    last time they reach), and the totals of days before `before_day`, in one transaction:
    the rows deleted, and whether none older is left."""
    with db.transaction():
        edge = db.query(
            "SELECT at_us FROM generations WHERE at_us < ? ORDER BY at_us LIMIT 1 OFFSET ?",
            (before_us, limit - 1),
        )
        if edge:
            deleted = db.execute("DELETE FROM generations WHERE at_us <= ?", (edge[0][0],))
        else:
            deleted = db.execute("DELETE FROM generations WHERE at_us < ?", (before_us,))
        db.execute("DELETE FROM daily_totals WHERE day < ?", (before_day.isoformat(),))
    return deleted, not edge
