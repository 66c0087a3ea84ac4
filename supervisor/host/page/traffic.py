"""The record's sections of the page: the traffic, and each key's last use and spending.

The traffic is requests, refusals and times to first token; a key's spending is against its
budget.

Reading the record is a database query, so each source keeps its answer a few seconds: the
page polls every 2 s, the database is asked at most once per `max_age_s`. Reads run off the
loop (the page calls sources in a thread); a lock keeps two polls from querying at once. A
record that cannot be read says why (`problem`), and the next poll after `max_age_s` tries
again. The day's spending is the store's (memory, the figure budgets enforce), never a query.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final, Protocol

from supervisor import paths
from supervisor.host import keys
from supervisor.host.page.memory import LedgerMemory
from supervisor.host.page.models import ModelsSection
from supervisor.host.page.sources import Sources
from supervisor.host.record import queries, report, schema
from supervisor.host.record.database import Target, failures, one_line, open_reader
from supervisor.host.record.ledger import Spent
from supervisor.protocol.documents import utc_now

SPANS: Final = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
LAST_USE: Final = timedelta(days=7)  # how far back a key's last use is looked for
TRAFFIC_MAX_AGE_S: Final = 5.0
KEY_USE_MAX_AGE_S: Final = 10.0


class PageSpending(Protocol):
    """What the page reads of the store: a key's spending today (record.store.Store)."""

    def spending(self, key_id: str) -> Spent | None: ...


class Cached:
    """A value read at most once per max_age_s, by one reader at a time."""

    def __init__(
        self,
        read: Callable[[], dict[str, Any]],
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self.max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        self._value: dict[str, Any] | None = None
        self._at = 0.0

    def get(self) -> dict[str, Any]:
        with self._lock:
            now = self._clock()
            if self._value is None or now - self._at >= self.max_age_s:
                self._value, self._at = self._read(), now
            return self._value


def _iso(value: datetime) -> str:
    return value.isoformat(timespec="seconds").replace("+00:00", "Z")


def _refusals(groups: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for group in groups:
        for code, count in group["refusals"].items():
            total[code] = total.get(code, 0) + count
    return dict(sorted(total.items()))


def traffic_of(target: Target, now: datetime) -> dict[str, Any]:
    """The traffic section from the record at target, as of now: per span, requests, refusals
    by reason and the figures per model and per build; and per build, the median time to first
    token of each hour of the last day. Raises one of database.failures() when it cannot be
    read."""
    db = open_reader(target)
    try:
        schema.check(db)
        spans: dict[str, Any] = {}
        for name, span in SPANS.items():
            since = now - span
            by_model = report.as_json(queries.usage(db, since, "model"), "model", since)
            by_build = report.as_json(queries.usage(db, since, "build"), "build", since)
            spans[name] = {
                "since": _iso(since),
                "requests": sum(group["requests"] for group in by_model["groups"]),
                "refusals": _refusals(by_model["groups"]),
                "byModel": by_model["groups"],
                "byBuild": by_build["groups"],
            }
        hours = queries.hourly(db, now - SPANS["day"], "build")
    finally:
        db.close()
    chart: dict[tuple[str, ...], dict[str, Any]] = {}
    for start, line in hours:
        if line.ttft_p50 is None:
            continue  # no time to first token that hour (refused, failed): nothing to draw
        engine, version, image, weights = line.group
        series = chart.setdefault(
            line.group,
            {
                "engine": engine,
                "engineVersion": version,
                "imageId": image,
                "weightsRevision": weights,
                "points": [],
            },
        )
        series["points"].append({"at": _iso(start), "p50": line.ttft_p50, "n": line.timed})
    return {
        **spans,
        "chart": {
            "since": _iso(now - SPANS["day"]),
            "until": _iso(now),
            "builds": list(chart.values()),
        },
    }


class Traffic:
    """The traffic section (sources.SectionSource), from the record at target."""

    def __init__(self, target: Target, max_age_s: float = TRAFFIC_MAX_AGE_S) -> None:
        self.target = target
        self.cache = Cached(self._read, max_age_s)

    def _read(self) -> dict[str, Any]:
        try:
            return traffic_of(self.target, utc_now())
        except failures() as exc:
            return {"problem": f"the record cannot be read: {one_line(exc)}"}

    def read(self) -> dict[str, Any]:
        return self.cache.get()


class KeyUse:
    """Each key's last use (from the record) and the day's spending against its budget (from
    the store; `default_budget` is [budget] daily_tokens, a key's own `budget` wins; an exempt
    key has none, and its spending is shown all the same)."""

    def __init__(
        self,
        target: Target,
        spending: PageSpending | None,
        keys_file: Path,
        default_budget: int,
        max_age_s: float = KEY_USE_MAX_AGE_S,
    ) -> None:
        self.target = target
        self.spending = spending
        self.keys_file = keys_file
        self.default_budget = default_budget
        self.last = Cached(self._last_use, max_age_s)

    def _last_use(self) -> dict[str, Any]:
        try:
            db = open_reader(self.target)
            try:
                schema.check(db)
                found = queries.last_use(db, utc_now() - LAST_USE)
            finally:
                db.close()
        except failures() as exc:
            return {"problem": one_line(exc)}
        return {"keys": {key: _iso(at) for key, at in found.items()}}

    def read(self) -> dict[str, dict[str, Any]] | None:
        try:
            issued = keys.load(self.keys_file)
        except keys.KeysFileInvalid:
            return None
        last = self.last.get().get("keys")
        use: dict[str, dict[str, Any]] = {}
        for key in issued:
            spent = self.spending.spending(key.id) if self.spending is not None else None
            budget = key.budget if key.budget is not None else (self.default_budget or None)
            if key.exempt:  # counted and shown, never held to a budget
                budget = None
            use[key.id] = {
                "lastUse": last.get(key.id) if last is not None else None,
                "lastUseKnown": last is not None,
                "spentTokens": spent.tokens if spent is not None else None,
                "spentRequests": spent.requests if spent is not None else None,
                "budget": budget,
                "exempt": key.exempt,
            }
        return use


def record_sources(
    data_dir: Path,
    target: Target | None,
    spending: PageSpending | None,
    default_budget: int,
    models_dir: Path | None = None,
) -> Sources:
    """The page's sources: the model library at models_dir (paths.models_dir's), and the
    record's sections; without a record (target None), those say "not available"."""
    memory = LedgerMemory(data_dir)
    library = ModelsSection(models_dir or paths.models_dir())
    if target is None:
        return Sources(memory, models=library)
    return Sources(
        memory,
        models=library,
        traffic=Traffic(target),
        key_use=KeyUse(target, spending, paths.keys_file(data_dir), default_budget),
    )
