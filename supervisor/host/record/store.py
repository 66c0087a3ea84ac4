"""The record as the gateway uses it: open it, record rows, read a key's spending, close it.

    store = Store.open(settings.record.target(data_dir), settings.record.retention_days)
    store.record(row)                 # never blocks, never raises; False: dropped (counted)
    store.spent(identity.key_id, day) # tokens today: committed plus queued (proxy.budget's
                                      # Spending); store.spending(...): Spent(tokens, requests)
                                      # or None when not known
    store.available, store.reason     # False and why: record nothing, enforce no budget
    store.close()                     # commits what is queued (within WriterTuning.stop_s)

`open` waits for the first try to open the database (at most CONNECT_S and a margin) so that
the gateway can say at its start whether it records; it never raises for a database that fails:
the store is then unavailable and keeps trying by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, date, datetime
from typing import Any, Final

from supervisor import logs
from supervisor.host.record.database import CONNECT_S, Target
from supervisor.host.record.ledger import SpendingLedger, Spent
from supervisor.host.record.row import Row
from supervisor.host.record.writer import UNAVAILABLE, Health, Writer, WriterTuning

OPEN_WAIT_S: Final = CONNECT_S + 5.0


class Store:
    def __init__(
        self,
        target: Target,
        retention_days: int,
        timing: WriterTuning | None = None,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.timing = timing or WriterTuning()
        self.target = target
        self.now = now
        self._ledger = SpendingLedger(self.timing.queue_rows, self.timing.batch_rows)
        self._writer = Writer(target, retention_days, self._ledger, self.timing, now)
        self._closed = False
        self._log: Any = logs.get("record")
        self._where = {"backend": target.kind, "where": target.describe()}

    @classmethod
    def open(
        cls,
        target: Target,
        retention_days: int,
        timing: WriterTuning | None = None,
        wait_s: float = OPEN_WAIT_S,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> Store:
        """Start the writer and wait (up to wait_s) for its first try to open the database."""
        store = cls(target, retention_days, timing, now)
        store._writer.start()
        store._writer.tried.wait(wait_s)
        return store

    def record(self, row: Row) -> bool:
        """Queue a row for the writer; never blocks, never raises. False: dropped, counted
        (the store is unavailable or closed, or its queue is full)."""
        if self._closed:
            self._ledger.drop("closed")
            return False
        if not self.health.available:
            self._ledger.drop("unavailable")
            return False
        return self._ledger.put(row)

    def spending(self, key_id: str, day: date | None = None) -> Spent | None:
        """What a key spent on a UTC day (today by default), tokens and requests: committed
        plus queued. None when the day's totals are not known (the store is unavailable, or
        the day began less than WriterTuning.refresh_s ago): no budget can be enforced then."""
        if not self.health.available:
            return None
        return self._ledger.spent(key_id, day or self.now().date())

    def spent(self, key_id: str, day: date | None = None) -> int:
        """The gateway's budget reading (proxy.budget.Spending): the tokens of `spending`,
        0 when they are not known. Memory only: never a database call."""
        found = self.spending(key_id, day)
        return found.tokens if found is not None else 0

    @property
    def health(self) -> Health:
        """The writer's word, unless a database call of its has gone unanswered for
        WriterTuning.stall_s: then unavailable (said once in the log), until the call returns."""
        if self._closed:
            return Health(False, "the record is closed")
        health = self._writer.health
        if not health.available:
            return health
        look = self._writer.stall.look(time.monotonic())
        if not look.stalled:
            return health
        reason = f"the database has not answered for {self.timing.stall_s:g} s"
        if look.first:
            self._log.warning(UNAVAILABLE, reason=reason, **self._where)
        return Health(False, reason)

    @property
    def available(self) -> bool:
        return self.health.available

    @property
    def reason(self) -> str | None:
        """Why the store is unavailable (one line, no secret), or None."""
        return self.health.reason

    @property
    def dropped(self) -> dict[str, int]:
        """Rows dropped so far, by reason: unavailable, queue_full, write_failed, closed."""
        return self._ledger.dropped()

    @property
    def committed(self) -> int:
        return self._writer.committed

    @property
    def queued(self) -> int:
        return self._ledger.queued

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking rows, commit what is queued (within WriterTuning.stop_s), close the
        database."""
        self._closed = True
        self._writer.stop()
        self._writer.join(self.timing.stop_s + 5.0 if timeout_s is None else timeout_s)
