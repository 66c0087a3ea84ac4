"""The rows waiting for the writer, and what each key has spent: committed plus waiting.

One lock covers the queue, the pending spending and the committed totals, so a reader of
`spent` never sees a batch in both or in neither while the writer settles it. `put` never
blocks beyond that lock: a full queue drops the row and counts it. The committed totals of a
day are those the writer last read from the database (every gateway's rows) plus what this
process committed since; until a day was read, `spent` for it is None (not known).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass
from datetime import date
from typing import Final

from supervisor.host.record.row import Row

KEPT_DAYS: Final = 2  # the committed totals of the latest days read: today, and yesterday


@dataclass(frozen=True, slots=True)
class Spent:
    """A key's spending on one UTC day: committed, plus recorded and not yet committed."""

    tokens: int
    requests: int


class SpendingLedger:
    """The rows queued for the writer, and each key's spending: committed plus queued."""

    def __init__(self, bound: int, batch: int) -> None:
        self.bound = bound
        self.batch = batch
        self.wake = threading.Event()  # set when the queue gets its first row, or a batch
        self._lock = threading.Lock()
        self._queue: deque[Row] = deque()
        self._pending: dict[tuple[date, str], list[int]] = {}
        self._committed: dict[date, dict[str, tuple[int, int]]] = {}
        self._dropped: Counter[str] = Counter()
        self._full = False  # the queue refused a row since the writer last looked

    def put(self, row: Row) -> bool:
        """Queue a row and count its spending; False (counted) when the queue is full."""
        with self._lock:
            queued = len(self._queue)
            if queued >= self.bound:
                self._dropped["queue_full"] += 1
                self._full = True
                return False
            self._queue.append(row)
            entry = self._pending.get((row.day, row.key_id))
            if entry is None:
                self._pending[(row.day, row.key_id)] = [row.tokens, 1]
            else:
                entry[0] += row.tokens
                entry[1] += 1
        if queued == 0 or queued + 1 == self.batch:
            self.wake.set()
        return True

    def drop(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self._dropped[reason] += count

    @property
    def queued(self) -> int:
        return len(self._queue)

    def take(self, limit: int) -> list[Row]:
        """Up to `limit` rows off the queue, oldest first; they count as pending until
        settled."""
        with self._lock:
            count = min(limit, len(self._queue))
            return [self._queue.popleft() for _ in range(count)]

    def settle(self, rows: list[Row], committed: bool, reason: str = "write_failed") -> None:
        """Rows taken are no longer pending: committed (their spending moves to the committed
        totals of a day read), or lost (dropped, counted under `reason`)."""
        with self._lock:
            for row in rows:
                key = (row.day, row.key_id)
                entry = self._pending[key]
                entry[0] -= row.tokens
                entry[1] -= 1
                if entry[1] == 0:
                    del self._pending[key]
                if committed:
                    day = self._committed.get(row.day)
                    if day is not None:
                        tokens, requests = day.get(row.key_id, (0, 0))
                        day[row.key_id] = (tokens + row.tokens, requests + 1)
            if not committed:
                self._dropped[reason] += len(rows)

    def discard(self, reason: str) -> int:
        """Drop every queued row (the database is gone); how many."""
        rows = self.take(self.bound)
        if rows:
            self.settle(rows, committed=False, reason=reason)
        return len(rows)

    def load_day(self, day: date, totals: dict[str, tuple[int, int]]) -> None:
        """The committed totals of a day as just read from the database."""
        with self._lock:
            self._committed[day] = dict(totals)
            for old in sorted(self._committed)[:-KEPT_DAYS]:
                del self._committed[old]

    def forget(self) -> None:
        """The committed totals are no longer known (the database went away)."""
        with self._lock:
            self._committed.clear()

    def spent(self, key_id: str, day: date) -> Spent | None:
        """Committed plus pending for a key on a day; None when that day's committed totals
        have not been read."""
        with self._lock:
            committed = self._committed.get(day)
            if committed is None:
                return None
            tokens, requests = committed.get(key_id, (0, 0))
            pending = self._pending.get((day, key_id))
            if pending is not None:
                tokens += pending[0]
                requests += pending[1]
            return Spent(tokens, requests)

    def dropped(self) -> dict[str, int]:
        with self._lock:
            return dict(self._dropped)

    def was_full(self) -> bool:
        """Whether the queue refused a row since the last call."""
        with self._lock:
            full, self._full = self._full, False
            return full
