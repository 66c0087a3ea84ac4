"""The record's one writer: a thread that commits the queued rows in batches, off the request path.

It commits when a batch (WriterTuning.batch_rows) is queued, or when the oldest queued row has
waited WriterTuning.flush_s (250 ms) since the last commit: a row recorded while the database
keeps up is committed within flush_s plus the time of the commits ahead of it:
COMMITTED_WITHIN_S (1 s) is the bound promised and tested. Between commits it re-reads
today's per-key totals (every refresh_s: what other gateways on one PostgreSQL spent) and
prunes rows past the retention, a batch at a time, while nothing waits.

A database call that has not returned after stall_s (a frozen server: nothing fails, nothing
answers) makes the store unavailable too, said once, until the call returns.

When the database cannot be opened or written, the writer says so once (`record unavailable`,
with the reason), drops what is queued (counted), and tries again after a back-off that doubles
from backoff_s to backoff_max_s; a stop interrupts the wait. Once a connection, the migration
and a probe write succeed, it says so once (`record available`) and goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from supervisor import logs
from supervisor.host.record import batch, schema
from supervisor.host.record.database import Database, Target, connect, failures, one_line
from supervisor.host.record.ledger import SpendingLedger
from supervisor.host.record.row import epoch_us
from supervisor.host.record.stall import Stall

NOT_YET: Final = "not opened yet"
UNAVAILABLE: Final = "record unavailable: rows are not recorded and budgets not enforced"
# The promise, tested by killing a writer mid-load: a row recorded this long ago is committed
# (while the database is available and keeps up): flush_s, a commit, and room for a busy machine.
COMMITTED_WITHIN_S: Final = 1.0


@dataclass(frozen=True)
class WriterTuning:
    """The writer's pace and bounds: when it commits, retries, prunes, and gives up waiting."""

    flush_s: float = 0.25  # the longest a queued row waits for a commit to begin
    batch_rows: int = 500  # rows in one transaction at most; this many queued: commit now
    queue_rows: int = 20_000  # queued rows at most; more are dropped (counted)
    refresh_s: float = 1.0  # today's totals re-read from the database this often
    prune_every_s: float = 3600.0
    prune_rows: int = 5_000  # rows deleted in one transaction
    backoff_s: float = 0.5  # the first retry of a database that failed
    backoff_max_s: float = 15.0
    stop_s: float = 10.0  # what is queued at a stop is committed within this long, if it can be
    stall_s: float = 10.0  # a database call unanswered this long: the store is unavailable


@dataclass(frozen=True)
class Health:
    available: bool
    reason: str | None  # why not, when not available


class Writer(threading.Thread):
    def __init__(
        self,
        target: Target,
        retention_days: int,
        ledger: SpendingLedger,
        timing: WriterTuning,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        super().__init__(name="lucia-record-writer", daemon=True)
        self.target = target
        self.retention_days = retention_days
        self.ledger = ledger
        self.timing = timing
        self.now = now
        self.health = Health(False, NOT_YET)
        self.committed = 0  # rows committed by this writer
        self.tried = threading.Event()  # set once the first open was tried
        self._stopping = threading.Event()
        self.stall = Stall(timing.stall_s)  # the call under way, which the store watches
        self._failures = failures()
        self._db: Database | None = None
        self._last_commit = float("-inf")
        self._next_refresh = 0.0
        self._next_prune = 0.0
        self._pruning = False
        self._pruned = (0, 0)  # rows deleted and transactions, in the pruning under way
        self._full_since: float | None = None  # the queue overflowed since then
        self._dropped_at_down = 0
        self._down_since = 0.0
        self._log: Any = logs.get("record")
        self._where = {"backend": target.kind, "where": target.describe()}

    def stop(self) -> None:
        self._stopping.set()
        self.ledger.wake.set()

    # -- the loop ----------------------------------------------------------------------------

    def run(self) -> None:
        backoff = self.timing.backoff_s
        while not self._stopping.is_set():
            if self._db is None:
                try:
                    self._open()
                except self._failures as exc:
                    self._down(one_line(exc))
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, self.timing.backoff_max_s)
                    continue
                backoff = self.timing.backoff_s
            try:
                self._turn()
            except Exception as exc:  # a writer that dies would leave rows queued for ever
                if not isinstance(exc, self._failures):
                    self._log.exception("record writer: an unexpected error", **self._where)
                self._lose(one_line(exc))
                self._stopping.wait(backoff)
        self._finish()

    def _open(self) -> None:
        db = connect(self.target)
        try:
            before = schema.migrate(db)
            batch.probe(db)
            self._db = db
            self._refresh(time.monotonic())
        except BaseException:
            self._db = None
            db.close()
            raise
        self._pruning = self.retention_days > 0
        self._next_prune = time.monotonic() + self.timing.prune_every_s
        self._up(before)

    def _turn(self) -> None:
        """One step: a commit, a refresh, a prune step, or a wait for the next of them."""
        t = self.timing
        now = time.monotonic()
        self._watch_queue(now)
        queued = self.ledger.queued
        if queued and (queued >= t.batch_rows or now >= self._last_commit + t.flush_s):
            self._commit(now)
        elif now >= self._next_refresh:
            self._refresh(now)
        elif self._pruning and not queued:
            self._prune()
        else:
            if now >= self._next_prune and self.retention_days > 0:
                self._pruning = True
                self._next_prune = now + t.prune_every_s
            due = min(self._next_refresh, self._next_prune)
            if queued:
                due = min(due, self._last_commit + t.flush_s)
            self.ledger.wake.wait(max(0.0, due - now))
            self.ledger.wake.clear()

    def _commit(self, now: float) -> None:
        assert self._db is not None
        rows = self.ledger.take(self.timing.batch_rows)
        try:
            with self._busy():
                batch.write(self._db, rows)
        except BaseException:
            self.ledger.settle(rows, committed=False)
            raise
        self.ledger.settle(rows, committed=True)
        self.committed += len(rows)
        self._last_commit = now

    def _refresh(self, now: float) -> None:
        assert self._db is not None
        today = self.now().date()
        with self._busy():
            totals = batch.day_totals(self._db, today)
        self.ledger.load_day(today, totals)
        self._next_refresh = now + self.timing.refresh_s

    def _prune(self) -> None:
        """One batch of the pruning under way; said once, when it is done."""
        assert self._db is not None
        cutoff = self.now() - timedelta(days=self.retention_days)
        with self._busy():
            deleted, done = batch.prune_step(
                self._db, epoch_us(cutoff), cutoff.date(), self.timing.prune_rows
            )
        self._pruned = (self._pruned[0] + deleted, self._pruned[1] + 1)
        if done:
            self._pruning = False
            rows, batches = self._pruned
            self._pruned = (0, 0)
            if rows:
                self._log.info(
                    "record pruned",
                    rows=rows,
                    batches=batches,
                    before=cutoff.date().isoformat(),
                )

    def _finish(self) -> None:
        """At a stop: commit what is queued while the database takes it, then close."""
        deadline = time.monotonic() + self.timing.stop_s
        while self._db is not None and self.ledger.queued and time.monotonic() < deadline:
            try:
                self._commit(time.monotonic())
            except self._failures as exc:
                self._lose(one_line(exc))
        self.ledger.discard("closed")
        if self._db is not None:
            self._db.close()
            self._db = None
        self._log.info(
            "record closed", committed=self.committed, dropped=self.ledger.dropped(), **self._where
        )

    # -- availability, said once per change ---------------------------------------------------

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """A database call: the store looks at `stall` to tell a database that stopped
        answering (a frozen server, a lost network) from one that is slow."""
        began = time.monotonic()
        self.stall.begin(began)
        try:
            yield
        except BaseException:
            self.stall.end(failed=True)  # the failure is said as such
            raise
        if self.stall.end(failed=False):
            took = round(time.monotonic() - began, 1)
            self._log.info("record available again", stalled_s=took, **self._where)

    def _up(self, before: int) -> None:
        was = self.health
        self.health = Health(True, None)
        self.tried.set()
        if was.reason == NOT_YET:
            self._log.info(
                "record opened",
                schema=schema.VERSION,
                migrated_from=before,
                retention_days=self.retention_days,
                **self._where,
            )
        else:
            lost = sum(self.ledger.dropped().values()) - self._dropped_at_down
            self._log.info(
                "record available again",
                dropped=lost,
                down_s=round(time.monotonic() - self._down_since, 1),
                **self._where,
            )

    def _down(self, reason: str) -> None:
        was = self.health
        self.health = Health(False, reason)  # first: no row is queued after the discard below
        self.ledger.forget()
        self.ledger.discard("unavailable")
        self.tried.set()
        if was.available or was.reason == NOT_YET:
            self._dropped_at_down = sum(self.ledger.dropped().values())
            self._down_since = time.monotonic()
            self._log.warning(UNAVAILABLE, reason=reason, **self._where)

    def _lose(self, reason: str) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        self._down(reason)

    def _watch_queue(self, now: float) -> None:
        """Say once when the queue overflows, and once when it has had room for a while."""
        if self.ledger.was_full():
            if self._full_since is None:
                self._log.warning(
                    "record queue full: rows are dropped", bound=self.ledger.bound, **self._where
                )
            self._full_since = now
        elif self._full_since is not None and now - self._full_since > self.timing.refresh_s:
            self._full_since = None
            self._log.info(
                "record queue has room again", dropped=self.ledger.dropped(), **self._where
            )
