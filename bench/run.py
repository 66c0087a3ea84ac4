"""Run the benchmark suite: `.venv/bin/python -m bench.run [--quick] [--only NAME[,NAME]]`.

Each measurement runs against the real dockerd beside a baseline measured in the same run; the
table is printed and written to bench/RESULTS.md (the full suite) or bench/RESULTS-partial.md
(--quick or --only). Nothing here passes or fails on a timing.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from . import lab as lab_module
from .lab import Lab
from .measurements import MEASUREMENTS
from .measurements.common import Plan, Shared
from .procfs import code_version, dockerd, loadavg, machine, supervisor_digest
from .report import Row, text_table, write_results

HERE = Path(__file__).resolve().parent
Measure = Callable[[Lab, Plan, Shared], list[Row]]
# idle runs before adoption: the idle worker is then the one that built the images, as a
# long-lived worker has; the adoption row adds the RSS of a freshly adopted worker.
RUN_ORDER = ("ack", "ready", "stop", "idle", "heartbeat", "adoption", "cancel", "scale")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="Benchmark lucia-supervisor against the real dockerd, with baselines.",
    )
    parser.add_argument("--quick", action="store_true", help="fewer samples: a smoke test")
    parser.add_argument(
        "--only",
        metavar="NAME[,NAME]",
        help=f"run only these measurements: {', '.join(MEASUREMENTS)}",
    )
    parser.add_argument("--out", type=Path, help="results file (default: see above)")
    parser.add_argument(
        "--clean",
        metavar="RUN_ID",
        help="only remove what an earlier, killed run left behind (its id is in every name)",
    )
    args = parser.parse_args(argv)
    names = list(MEASUREMENTS)
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in MEASUREMENTS]
        if unknown:
            parser.error(f"unknown measurement(s) {unknown}; choose from {names}")
        names = [name for name in names if name in wanted]
    args.names = names
    if args.out is None:
        partial = args.quick or len(names) < len(MEASUREMENTS)
        args.out = HERE / ("RESULTS-partial.md" if partial else "RESULTS.md")
    return args


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _error_row(name: str, exc: BaseException) -> Row:
    text = " ".join(str(exc).split())[:300] or type(exc).__name__
    return Row(name, f"ERROR: {type(exc).__name__}", "", None, None, 0, "-", "-", note=text)


class Suite:
    def __init__(self, lab: Lab, plan: Plan) -> None:
        self.lab = lab
        self.plan = plan
        self.shared = Shared()
        self.rows: list[Row] = []
        self.durations: dict[str, float] = {}
        self.failed = False
        self.problems: list[str] = []

    def measure(self, name: str) -> list[Row]:
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        started = time.perf_counter()
        daemon = dockerd()
        try:
            rows = MEASUREMENTS[name](self.lab, self.plan, self.shared)
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one broken measurement must not lose the others
            traceback.print_exc()
            self.failed = True
            rows = [_error_row(name, exc)]
        self.durations[name] = time.perf_counter() - started
        if dockerd() != daemon:  # the machine is shared: someone else restarted dockerd
            warning = (
                f"dockerd was restarted during '{name}' (not by the bench: {daemon} -> "
                f"{dockerd()}, pid and start tick); its figures are not representative"
            )
            self.problems.append(warning)
            for row in rows:
                row.note = f"WARNING: {warning}. {row.note}"
        print(text_table(rows), flush=True)
        return rows

    def setup(self, names: list[str]) -> None:
        """The main engine's first start (recipe and grammar image builds), timed on its own."""
        if set(names) & {"ack", "ready", "stop", "adoption", "idle", "scale"}:
            print(f"[{time.strftime('%H:%M:%S')}] setup: first start of the main engine ...")
            started = time.perf_counter()
            self.lab.main()
            self.durations["setup (builds, first start)"] = time.perf_counter() - started

    def run(self, names: list[str]) -> None:
        self.setup(names)
        pending = [name for name in RUN_ORDER if name in names]
        while pending:
            name = pending.pop(0)
            if name == "idle" and "heartbeat" in pending:
                self.rows += self._idle_beside_heartbeat()
                pending.remove("heartbeat")
            else:
                self.rows += self.measure(name)

    def _idle_beside_heartbeat(self) -> list[Row]:
        """Both are passive waits: the idle window runs during the slow build (saves 60 s)."""
        self.lab.main()
        idle_rows: list[Row] = []
        thread = threading.Thread(
            target=lambda: idle_rows.extend(self.measure("idle")), name="idle", daemon=True
        )
        thread.start()
        heartbeat_rows = self.measure("heartbeat")
        thread.join()
        return idle_rows + heartbeat_rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.clean:
        lab_module.adopt_run(args.clean)
        problems = Lab().cleanup()
        for problem in problems:
            print(f"cleanup: {problem}", file=sys.stderr)
        return 1 if problems else 0
    plan = Plan(quick=args.quick)
    command = shlex.join(["python", "-m", "bench.run", *(argv or sys.argv[1:])])
    signal.signal(signal.SIGTERM, _interrupt)
    began = time.perf_counter()
    lab = Lab()
    mode = "quick" if args.quick else "full"
    print(f"bench run {lab_module.RUN_ID}: {', '.join(args.names)} ({mode})")
    info = machine(lab.client)
    info["code"] = code_version(HERE.parent)
    digest = supervisor_digest(HERE.parent)
    load_start = loadavg()
    suite = Suite(lab, plan)
    interrupted = False
    try:
        suite.run(args.names)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: cleaning up", file=sys.stderr)
    finally:
        print(f"[{time.strftime('%H:%M:%S')}] cleanup ...", flush=True)
        problems = suite.problems + lab.cleanup()
        wall = time.perf_counter() - began
        if supervisor_digest(HERE.parent) != digest:
            problems.append(
                f"supervisor/ changed on disk during the run (at start: {info['code']}; at end: "
                f"{code_version(HERE.parent)}): workers started at different times may have run "
                "different code"
            )
    for problem in problems:
        print(f"cleanup: {problem}", file=sys.stderr)
    if interrupted:
        return 130
    order = list(MEASUREMENTS)
    suite.rows.sort(key=lambda row: order.index(row.key) if row.key in order else len(order))
    print()
    print(text_table(suite.rows))
    print(f"\nwall time {wall:.0f} s ({wall / 60:.1f} min); results in {args.out}")
    write_results(
        args.out,
        rows=suite.rows,
        machine=info,
        command=command,
        wall=wall,
        durations=suite.durations,
        run_id=lab_module.RUN_ID,
        load=(load_start, loadavg()),
        problems=problems,
    )
    return 1 if suite.failed else 0


if __name__ == "__main__":
    sys.exit(main())
