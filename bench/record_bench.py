"""Record benchmark: `.venv/bin/python -m bench.record_bench [--rows N] [--big N] [--no-postgres]`.

What the record costs, each figure beside a baseline measured in the same run:
- record() on the caller's thread (the gateway's event loop): median and p99 ns per call over
  batches of 1,000, with the writer committing beside it; against a locked deque append and
  `queue.Queue.put_nowait`. Building the Row (its checks) and spent() are shown too.
- rows committed a second through the store (queue, writer thread, batches of 500 with their
  daily totals), on SQLite and on PostgreSQL; against the same batches written directly
  (batch.write, no thread: the floor) and one row per transaction (what batching saves). The
  store and the floor run in turns, three times each: the medians.
- the commit delay: rows recorded at 2,000 a second for 5 s; from record() returning to the
  writer's count passing the row (polled every millisecond): p50, p99 and max, against the
  stated bound (writer.COMMITTED_WITHIN_S).
- the budget check at size, with `--big` rows in the record against 1,000 rows: spent(), the
  check the gateway makes (memory: today's totals as last read, plus what is queued), and a
  key's day total read from the database (one primary-key lookup), rounds interleaved.

PostgreSQL is a cluster of the bench's own (tests/postgres.py: initdb in a temp directory,
127.0.0.1). Prints tables; asserts nothing about timings.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.standalone import filesystem, machine, table  # noqa: E402
from supervisor import logs  # noqa: E402
from supervisor.host.record import batch, schema  # noqa: E402
from supervisor.host.record.database import Database, Target, connect  # noqa: E402
from supervisor.host.record.row import Build, Row, epoch_us  # noqa: E402
from supervisor.host.record.store import Store  # noqa: E402
from supervisor.host.record.writer import COMMITTED_WITHIN_S, WriterTuning  # noqa: E402

BATCH = 1000
ROUNDS = 3
KEYS = [f"key_{n:012x}" for n in range(1000)]


def make_row(n: int, at: datetime | None = None) -> Row:
    return Row(
        at=at or datetime.now(UTC),
        key_id=KEYS[n % len(KEYS)],
        model="qwen3-8b",
        engine="router",
        build=Build("0.32.0", "sha256:" + "ab" * 32, "e5a1f00d"),
        outcome="ok",
        prompt_tokens=512,
        completion_tokens=128,
        cached_tokens=256,
        wait_s=0.002,
        ttft_s=0.08,
        duration_s=1.9,
    )


def per_call(
    fn: Callable[[], object], calls: int, between: Callable[[], None]
) -> tuple[float, float]:
    """Median and p99 ns per call over batches of BATCH; `between` runs off the clock."""
    figures = []
    for _ in range(max(1, calls // BATCH)):
        start = time.perf_counter_ns()
        for _ in range(BATCH):
            fn()
        figures.append((time.perf_counter_ns() - start) / BATCH)
        between()
    figures.sort()
    return statistics.median(figures), figures[min(len(figures) - 1, int(len(figures) * 0.99))]


def drain(store: Store) -> None:
    while store.queued > store.timing.queue_rows // 4:
        time.sleep(0.001)


def caller_cost(target: Target, calls: int) -> list[tuple[str, ...]]:
    store = Store.open(target, 0)
    row = make_row(1)
    lock, plain = threading.Lock(), deque[Row]()

    def locked_append() -> None:
        with lock:
            plain.append(row)

    stdlib: queue.Queue[Row] = queue.Queue()
    figures = [
        ("deque.append under a lock (floor)", locked_append, plain.clear),
        ("queue.Queue.put_nowait (stdlib)", lambda: stdlib.put_nowait(row), stdlib.queue.clear),
        ("store.record(row)", lambda: store.record(row), lambda: drain(store)),
        ("Row(...) built and checked", lambda: make_row(1), lambda: None),
        ("store.spent(key) (memory only)", lambda: store.spent(row.key_id), lambda: None),
    ]
    rows = []
    for name, fn, between in figures:
        median, p99 = per_call(fn, calls, between)
        rows.append((name, f"{median:.0f}", f"{p99:.0f}"))
    dropped = store.dropped
    store.close()
    rows.append(("(rows the store dropped)", str(sum(dropped.values())), ""))
    return rows


def through_store(target: Target, count: int) -> float:
    """Rows a second from the first record() to the writer's commit of the last."""
    store = Store.open(target, 0)
    rows = [make_row(n) for n in range(count)]
    start = time.perf_counter()
    for n, row in enumerate(rows):
        store.record(row)
        if n % 1000 == 0:
            drain(store)
    while store.committed < count:
        time.sleep(0.001)
    took = time.perf_counter() - start
    lost = sum(store.dropped.values())
    store.close()
    assert lost == 0, f"the store dropped {lost} rows"
    return count / took


def direct(db: Database, count: int, per: int) -> float:
    rows = [make_row(n) for n in range(count)]
    start = time.perf_counter()
    for at in range(0, count, per):
        batch.write(db, rows[at : at + per])
    return count / (time.perf_counter() - start)


def commit_delay(target: Target, rate: int, seconds: float) -> tuple[float, float, float]:
    store = Store.open(target, 0)
    count = int(rate * seconds)
    recorded = [0.0] * count
    seen = [0.0] * count
    done = threading.Event()

    def poll() -> None:
        passed = 0
        while passed < count and not done.is_set():
            now, committed = time.perf_counter(), store.committed
            while passed < committed:
                seen[passed] = now
                passed += 1
            time.sleep(0.001)

    poller = threading.Thread(target=poll)
    poller.start()
    start = time.perf_counter()
    for n in range(count):
        store.record(make_row(n))
        recorded[n] = time.perf_counter()
        ahead = (n + 1) / rate - (recorded[n] - start)
        if ahead > 0:
            time.sleep(ahead)
    poller.join(30)
    done.set()
    store.close()
    delays = sorted(s - r for s, r in zip(seen, recorded, strict=True) if s)
    return (statistics.median(delays), delays[int(len(delays) * 0.99)], delays[-1])


def fill(db: Database, count: int) -> None:
    """count rows over 90 days and 1,000 keys, and their daily totals (90,000 of them for a
    large count): written in bulk (COPY on PostgreSQL), not through the writer."""
    first = datetime.now(UTC) - timedelta(days=89, hours=23)
    step_us = int(timedelta(days=90).total_seconds() * 1e6) // max(count, 1)
    base_us, template = epoch_us(first), batch.values(make_row(0))
    totals: dict[tuple[str, str], list[int]] = {}
    for start in range(0, count, 50_000):
        chunk = []
        for n in range(start, min(start + 50_000, count)):
            at_us, key = base_us + n * step_us, KEYS[n % len(KEYS)]
            chunk.append((at_us, key, *template[2:]))
            day = (first + timedelta(microseconds=n * step_us)).date().isoformat()
            entry = totals.setdefault((day, key), [0, 0])
            entry[0] += 640
            entry[1] += 1
        with db.transaction():
            db.bulk("generations", batch.COLUMNS, chunk)
    with db.transaction():
        db.executemany(batch.ADD_TOTAL, [(*k, *v) for k, v in sorted(totals.items())])
    db.execute("ANALYZE")


def lookup_ns(dbs: list[Database], calls: int) -> list[float]:
    """Each database's median ns per day-total lookup, their rounds interleaved."""
    today = datetime.now(UTC).date()
    keys = KEYS * (BATCH // len(KEYS) + 1)
    figures: list[list[float]] = [[] for _ in dbs]
    for _ in range(max(1, calls // BATCH)):
        for db, into in zip(dbs, figures, strict=True):
            start = time.perf_counter_ns()
            for key in keys[:BATCH]:
                batch.key_total(db, key, today)
            into.append((time.perf_counter_ns() - start) / BATCH)
    return [statistics.median(f) for f in figures]


def spent_ns(targets: list[Target], calls: int) -> list[float]:
    """Each store's median ns per spent() (today's totals read at its open), interleaved."""
    stores = [Store.open(target, 0) for target in targets]
    keys = KEYS * (BATCH // len(KEYS) + 1)
    figures: list[list[float]] = [[] for _ in stores]
    for _ in range(max(1, calls // BATCH)):
        for store, into in zip(stores, figures, strict=True):
            start = time.perf_counter_ns()
            for key in keys[:BATCH]:
                store.spent(key)
            into.append((time.perf_counter_ns() - start) / BATCH)
    for store in stores:
        store.close()
    return [statistics.median(f) for f in figures]


@contextmanager
def databases(work: Path, postgres: bool) -> Iterator[list[tuple[str, Callable[[str], Target]]]]:
    found: list[tuple[str, Callable[[str], Target]]] = [
        ("SQLite", lambda name: Target(path=work / f"{name}.sqlite3"))
    ]
    if not postgres:
        yield found
        return
    from tests.postgres import cluster

    with cluster() as pg:
        found.append(("PostgreSQL", lambda name: Target(dsn=pg.database())))
        yield found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows through the store")
    parser.add_argument("--big", type=int, default=1_000_000, help="rows for the budget check")
    parser.add_argument("--calls", type=int, default=200_000, help="calls per caller-cost row")
    parser.add_argument("--no-postgres", action="store_true")
    args = parser.parse_args()
    logs.configure(stream=sys.stderr)  # the store's log lines, apart from the tables
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, databases(Path(tmp), not args.no_postgres) as dbs:
        work = Path(tmp)
        tuning = WriterTuning()
        print(
            f"{machine()}; SQLite on {filesystem(work)}; flush {tuning.flush_s * 1000:g} ms, "
            f"batch {tuning.batch_rows} rows, queue {tuning.queue_rows}"
        )
        print()
        print("The caller's cost (SQLite store, writer committing beside it):")
        table(caller_cost(dbs[0][1]("caller"), args.calls), ("what", "median ns", "p99 ns"))
        rate_rows, delay_rows, size_rows = [], [], []
        for name, target in dbs:
            db = connect(target("direct"))
            schema.migrate(db)
            rates: dict[str, list[float]] = {"store": [], "floor": []}
            for round_ in range(ROUNDS):  # interleaved: a disk's moods fall on both
                rates["store"].append(through_store(target(f"store{round_}"), args.rows))
                rates["floor"].append(direct(db, args.rows, WriterTuning().batch_rows))
            store_rate, floor = (statistics.median(rates[k]) for k in ("store", "floor"))
            single = direct(db, 500, 1)
            db.close()
            rate_rows += [
                (
                    name,
                    "store (queue, writer thread)",
                    f"{store_rate:,.0f}",
                    f"x{store_rate / floor:.2f}",
                ),
                (name, "batch.write, 500 a transaction (floor)", f"{floor:,.0f}", "x1.00"),
                (name, "one row a transaction", f"{single:,.0f}", f"x{single / floor:.2f}"),
            ]
            p50, p99, worst = commit_delay(target("delay"), 2000, 5.0)
            bound = COMMITTED_WITHIN_S * 1000
            delay_rows.append(
                (
                    name,
                    f"{p50 * 1000:.0f}",
                    f"{p99 * 1000:.0f}",
                    f"{worst * 1000:.0f}",
                    f"{bound:.0f}",
                )
            )
            sized, targets = [], []
            for count in (1000, args.big):
                targets.append(target(f"size{count}"))
                db = connect(targets[-1])
                schema.migrate(db)
                fill(db, count)
                sized.append(db)
            small, big = lookup_ns(sized, 20_000)
            for db in sized:
                db.close()
            spent_small, spent_big = spent_ns(targets, 200_000)
            size_rows += [
                (
                    name,
                    "a day total read (SQL)",
                    f"{small / 1000:.2f}",
                    f"{big / 1000:.2f}",
                    f"x{big / small:.2f}",
                ),
                (
                    name,
                    "store.spent(key) (the check)",
                    f"{spent_small / 1000:.2f}",
                    f"{spent_big / 1000:.2f}",
                    f"x{spent_big / spent_small:.2f}",
                ),
            ]
        print(f"Rows committed a second ({args.rows:,} a run, median of {ROUNDS}):")
        table(rate_rows, ("database", "path", "rows/s", "vs floor"))
        print("Commit delay, 2,000 rows a second for 5 s (ms from record() to committed):")
        table(delay_rows, ("database", "p50", "p99", "max", "bound"))
        print(f"The budget check at size, µs a call: a record of 1,000 rows vs {args.big:,}:")
        table(size_rows, ("database", "what", "1,000 rows", f"{args.big:,} rows", "ratio"))
    print(f"whole run {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
