"""What the record says about a span of time: per key, model, engine or build, in two scans.

The first scan counts requests, outcomes and tokens per group and outcome in SQL. The second
reads the times to first token in order, per group, and keeps only the few values at the ranks
the percentiles need: memory stays small at any size. SQLite has no percentile function and
PostgreSQL's `percentile_cont` would be one dialect more, so the percentile is computed here,
the way `percentile_cont` (and numpy's default) does it: linear between the two closest ranks.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, Literal

from supervisor.host.record import schema
from supervisor.host.record.database import Database, Target, open_reader
from supervisor.host.record.row import REFUSED, epoch_us

By = Literal["key", "model", "engine", "build"]
GROUPS: Final[dict[By, tuple[str, ...]]] = {
    "key": ("key_id",),
    "model": ("model",),
    "engine": ("engine",),
    "build": ("engine", "engine_version", "image_id", "weights_revision"),
}
PERCENTILES: Final = (0.5, 0.95)
HOUR_US: Final = 3_600_000_000


def ranks(count: int, p: float) -> tuple[int, int, float]:
    """Pure: the two ranks (0-based) a percentile lies between in `count` sorted values, and
    how far from the first: percentile_cont's interpolation."""
    position = p * (count - 1)
    low = math.floor(position)
    return low, min(low + 1, count - 1), position - low


def percentile(ordered: Sequence[float], p: float) -> float | None:
    """Pure: the p-th percentile (0..1) of sorted values, as percentile_cont; None if empty."""
    if not ordered:
        return None
    low, high, weight = ranks(len(ordered), p)
    return ordered[low] + (ordered[high] - ordered[low]) * weight


@dataclass
class Line:
    """One group's figures. `outcomes` counts every outcome; `refusals` the refused by code."""

    group: tuple[str, ...]
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timed: int = 0  # rows with a time to first token
    outcomes: dict[str, int] = field(default_factory=dict)
    ttft_p50: float | None = None
    ttft_p95: float | None = None

    @property
    def refusals(self) -> dict[str, int]:
        return {
            outcome[len(REFUSED) :]: count
            for outcome, count in sorted(self.outcomes.items())
            if outcome.startswith(REFUSED)
        }


def _int(value: object) -> int:
    return int(value) if value is not None else 0  # type: ignore[call-overload]


def count(db: Database, since: datetime, by: By) -> dict[tuple[str, ...], Line]:
    """The first scan: requests, outcomes and tokens per group."""
    return _count(db, since, GROUPS[by])


def _count(db: Database, since: datetime, grouped: Sequence[str]) -> dict[tuple[str, ...], Line]:
    columns = ", ".join(grouped)
    found = db.query(
        f"SELECT {columns}, outcome, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), "  # noqa: S608 - the columns are ours
        f"SUM(cached_tokens), COUNT(ttft_s) FROM generations WHERE at_us >= ? "
        f"GROUP BY {columns}, outcome",
        (epoch_us(since),),
    )
    width = len(grouped)
    lines: dict[tuple[str, ...], Line] = {}
    for record in found:
        group = tuple(str(value) for value in record[:width])
        outcome, requests, prompt, completion, cached, timed = record[width:]
        line = lines.setdefault(group, Line(group))
        line.requests += _int(requests)
        line.prompt_tokens += _int(prompt)
        line.completion_tokens += _int(completion)
        line.cached_tokens += _int(cached)
        line.timed += _int(timed)
        line.outcomes[str(outcome)] = line.outcomes.get(str(outcome), 0) + _int(requests)
    return lines


def pick(
    ordered: Iterable[tuple[tuple[str, ...], float]], lines: dict[tuple[str, ...], Line]
) -> None:
    """Pure: fill each line's percentiles from its groups' times, sorted within each group,
    keeping only the values at the ranks wanted."""
    needed: set[int] = set()
    seen: dict[int, float] = {}
    group: tuple[str, ...] | None = None
    index = 0

    def finish() -> None:
        line = lines.get(group) if group is not None else None
        if line is None or not needed <= seen.keys():
            return
        values = []
        for low, high, weight in (ranks(line.timed, p) for p in PERCENTILES):
            values.append(seen[low] + (seen[high] - seen[low]) * weight)
        line.ttft_p50, line.ttft_p95 = values

    for key, value in ordered:
        if key != group:
            finish()
            group, index, seen = key, 0, {}
            line = lines.get(key)
            needed = {r for p in PERCENTILES for r in ranks(line.timed, p)[:2]} if line else set()
        if index in needed:
            seen[index] = value
        index += 1
    finish()


def usage(db: Database, since: datetime, by: By) -> list[Line]:
    """Every group's figures since a time, largest by requests first; both scans read one
    snapshot, so the ranks the first counted are the rows the second reads."""
    return _usage(db, since, GROUPS[by])


def _usage(db: Database, since: datetime, grouped: Sequence[str]) -> list[Line]:
    columns = ", ".join(grouped)
    with db.snapshot():
        lines = _count(db, since, grouped)
        ordered = (
            (tuple(str(value) for value in record[:-1]), float(record[-1]))
            for record in db.stream(
                f"SELECT {columns}, ttft_s FROM generations "  # noqa: S608 - the columns are ours
                f"WHERE at_us >= ? AND ttft_s IS NOT NULL ORDER BY {columns}, ttft_s",
                (epoch_us(since),),
            )
        )
        pick(ordered, lines)
    return sorted(lines.values(), key=lambda line: (-line.requests, line.group))


def hourly(db: Database, since: datetime, by: By) -> list[tuple[datetime, Line]]:
    """`usage` per group and UTC hour: each line with the start of its hour, oldest first
    (the page's chart of the time to first token, where a change of build shows)."""
    lines = _usage(db, since, (*GROUPS[by], f"at_us / {HOUR_US}"))
    found = []
    for line in lines:
        start = datetime.fromtimestamp(int(line.group[-1]) * HOUR_US // 1_000_000, UTC)
        line.group = line.group[:-1]
        found.append((start, line))
    return sorted(found, key=lambda item: (item[0], item[1].group))


def last_use(db: Database, since: datetime) -> dict[str, datetime]:
    """Per key id, the time of its latest row since a time."""
    found = db.query(
        "SELECT key_id, MAX(at_us) FROM generations WHERE at_us >= ? GROUP BY key_id",
        (epoch_us(since),),
    )
    return {
        str(key): datetime.fromtimestamp(_int(at) // 1_000_000, UTC).replace(
            microsecond=_int(at) % 1_000_000
        )
        for key, at in found
    }


def read(target: Target, since: datetime, by: By) -> list[Line]:
    """`usage` of the record at target, opened for this one reading (the command's and the
    owner API's); raises one of database.failures() when it cannot be read."""
    db = open_reader(target)
    try:
        schema.check(db)
        return usage(db, since, by)
    finally:
        db.close()
