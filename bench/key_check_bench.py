"""Key check benchmark: `.venv/bin/python bench/key_check_bench.py [--keys N] [--calls N]`.

What the gateway's key check costs per request (supervisor.host.keycheck.Verifier.verify),
with 1,000 issued keys in keys.json, for an issued key, the owner key, and an unknown key;
against baselines in the same process: a plain `==` of two strings (llama-swap's check), and
one SHA-256 of the key with a dict lookup (the floor of a hashed check). --calls calls are made
in batches of 1,000; each batch gives one figure in ns per call, and the table shows the median
and the 99th percentile over the batches. The verifier rechecks keys.json once a second, as it
does in the gateway, so the stat is inside the figures.

Prints a table; asserts nothing about timings. The issue's goal: under 20 µs per check.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from supervisor import paths  # noqa: E402
from supervisor.host import keys  # noqa: E402
from supervisor.host.keycheck import Verifier  # noqa: E402

BATCH = 1000
GOAL_NS = 20_000


def measure(check: Callable[[str], object], presented: str, calls: int) -> tuple[float, float]:
    """Median and p99 of ns per call over batches of BATCH calls."""
    figures = []
    for _ in range(max(1, calls // BATCH)):
        start = time.perf_counter_ns()
        for _ in range(BATCH):
            check(presented)
        figures.append((time.perf_counter_ns() - start) / BATCH)
    figures.sort()
    return statistics.median(figures), figures[min(len(figures) - 1, int(len(figures) * 0.99))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=keys.MAX_KEYS)
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        path = paths.keys_file(data)
        now = datetime.now(UTC)
        issued = [keys.generate(f"k{n}", now, None) for n in range(args.keys)]
        keys.save(path, [new.entry for new in issued])
        (data / "owner").write_text("o" * 48 + "\n")
        (data / "inference").write_text("i" * 48 + "\n")
        verifier = Verifier.open(path, data / "owner", data / "inference")
        middle = issued[len(issued) // 2].secret
        assert verifier.verify(middle) is not None
        assert verifier.verify("o" * 48) is not None
        unknown = keys.PREFIX + "x" * 43
        assert verifier.verify(unknown) is None

        fixed = "o" * 48
        table = {keys.digest(new.secret): new.entry for new in issued}

        def plain(presented: str) -> bool:
            return presented == fixed

        def floor(presented: str) -> object:
            return table.get(hashlib.sha256(presented.encode()).digest())

        rows = [
            ("plain == (llama-swap's check)", plain, fixed),
            ("SHA-256 + dict lookup (the floor)", floor, middle),
            ("verify: an issued key", verifier.verify, middle),
            ("verify: the owner key", verifier.verify, fixed),
            ("verify: an unknown key", verifier.verify, unknown),
        ]
        print(
            f"key check, {args.keys} issued keys, {args.calls} calls per row, "
            f"python {platform.python_version()}, {platform.machine()}"
        )
        print(f"{'what':38} {'median ns':>10} {'p99 ns':>10}  goal")
        for name, check, presented in rows:
            median, p99 = measure(check, presented, args.calls)
            goal = (
                ""
                if not name.startswith("verify")
                else ("met" if median < GOAL_NS else "MISSED") + " (< 20 µs)"
            )
            print(f"{name:38} {median:10.0f} {p99:10.0f}  {goal}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
