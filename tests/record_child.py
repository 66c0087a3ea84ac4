"""A record writer that a test kills: it records rows steadily and reports each one answered.

    python -m tests.record_child sqlite PATH | postgresql DSN

Each row's prompt tokens are its number; a line `NUMBER MONOTONIC` goes to stdout once
record() returned, as the gateway answers its client after recording. Logs go to stderr.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from supervisor import logs
from supervisor.host.record.database import Target
from supervisor.host.record.store import Store
from tests.record_world import OTHER, row

RATE = 2000  # rows a second, about


def main() -> None:
    logs.configure(stream=sys.stderr)
    kind, where = sys.argv[1], sys.argv[2]
    target = Target(path=Path(where)) if kind == "sqlite" else Target(dsn=where)
    store = Store.open(target, retention_days=0)
    if not store.available:
        sys.exit(f"the store is unavailable: {store.reason}")
    out = sys.stdout
    number = 0
    started = time.monotonic()
    while True:
        key = OTHER if number % 3 == 0 else "owner"
        if store.record(row(key_id=key, prompt=number, completion=number % 7)):
            out.write(f"{number} {time.monotonic()}\n")
            out.flush()
        number += 1
        ahead = number / RATE - (time.monotonic() - started)
        if ahead > 0:
            time.sleep(ahead)


if __name__ == "__main__":
    main()
