"""The whole suite as CI runs it: the shared phase side by side, then the alone phase.

    .venv/bin/python -m tests.run                 # as root, after scripts/machine.sh
    .venv/bin/python -m tests.run -x tests/faults # pytest's own arguments pass through

The shared phase runs `--workers` pytest-xdist processes (tests/schedule.py says which cases go
together); the alone phase then runs the cases marked `alone` in this process's child, one by one.
Both phases always run; the exit status is the first failing phase's (pytest's own codes), and
"no case selected" in one phase is not a failure when the other ran some.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

WORKERS = 3  # most cases wait on dockerd or systemd; a fourth process only adds contention
NO_TESTS = 5  # pytest's exit code when nothing was selected


def phase(name: str, extra: list[str], pytest_args: list[str]) -> tuple[int, float]:
    started = time.monotonic()
    command = [sys.executable, "-m", "pytest", f"--phase={name}", *extra, *pytest_args]
    print(f"==> tests.run: the {name} phase: {' '.join(command[1:])}", flush=True)
    code = subprocess.run(command, check=False).returncode
    took = time.monotonic() - started
    print(f"==> tests.run: the {name} phase ended with {code} after {took:.0f} s", flush=True)
    return code, took


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=WORKERS,
        help=f"processes in the shared phase (default {WORKERS})",
    )
    known, pytest_args = parser.parse_known_args(argv)
    shared = ["-n", str(known.workers), "--dist", "loadscope", "--no-loadscope-reorder"]
    codes = [phase("shared", shared, pytest_args)[0], phase("alone", [], pytest_args)[0]]
    if all(code == NO_TESTS for code in codes):
        return NO_TESTS
    return next((code for code in codes if code not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main())
