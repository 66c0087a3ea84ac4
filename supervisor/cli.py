"""lucia-supervisor: the command line. Host commands only read and write files."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Final

from supervisor.protocol import host
from supervisor.protocol.documents import STATES, State, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from supervisor.schemas import checked_in

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNANSWERED: Final = 3
EXIT_CONFIG: Final = 78  # EX_CONFIG: restarting will not help until the recipe is fixed
DEFAULT_DATA_DIR: Final = "~/.local/share/lucia/host/data"


def data_dir_from(value: str | None) -> Path:
    """The data directory: the argument, then LUCIA_DATA_DIR, then the default."""
    raw = value or os.environ.get("LUCIA_DATA_DIR") or DEFAULT_DATA_DIR
    return Path(raw).expanduser().absolute()


def _print_err(message: str) -> None:
    print(f"lucia-supervisor: {message}", file=sys.stderr)


def _changes(directory: Path, stop: threading.Event) -> Iterator[None]:
    """Yield on every change in directory, and at least twice a second."""
    from watchfiles import watch

    yield None
    for _ in watch(
        directory, stop_event=stop, rust_timeout=500, yield_on_timeout=True, debounce=20, step=10
    ):
        yield None


def await_state(
    data_dir: Path, name: str, generation: int, want: set[State], timeout: float
) -> int:
    """Wait until the status answers generation with a wanted state (0) or failed (1); else 3."""
    directory = host.engine_dir(data_dir, name)
    deadline = time.monotonic() + timeout
    stop = threading.Event()
    last = ""
    try:
        for _ in _changes(directory, stop):
            reading = host.read_status(data_dir, name, generation)
            status = reading.status
            if reading.answer == "current" and status is not None:
                if status.state in want:
                    print(f"{name}: {status.state}" + (f" at {status.url}" if status.url else ""))
                    return EXIT_OK
                if status.state == "failed":
                    _print_err(f"{name} failed: {status.message}")
                    return EXIT_FAILED
            if reading.answer == "unavailable" and status is not None:
                _print_err(f"{name}: {reading.reason}")
                return EXIT_UNANSWERED
            if reading.reason != last and sys.stderr.isatty():
                print(f"{name}: {reading.reason}", file=sys.stderr)
            last = reading.reason
            if time.monotonic() >= deadline:
                _print_err(f"{name}: timed out after {timeout:g}s ({reading.reason})")
                return EXIT_UNANSWERED
    finally:
        stop.set()
    return EXIT_UNANSWERED


def _cmd_request(args: argparse.Namespace) -> int:
    data_dir = data_dir_from(args.data_dir)
    generation = host.request(data_dir, args.name, args.desired)
    print(generation, flush=True)
    if not args.wait:
        return EXIT_OK
    return await_state(data_dir, args.name, generation, {args.desired}, args.timeout)


def _cmd_wait(args: argparse.Namespace) -> int:
    data_dir = data_dir_from(args.data_dir)
    directory = host.engine_dir(data_dir, args.name)
    desired = host.read_desired(directory)
    if desired is None:
        _print_err(f"no valid request in {directory / host.DESIRED}; use 'request' first")
        return EXIT_UNANSWERED
    return await_state(data_dir, args.name, desired.generation, {args.state}, args.timeout)


def _engine_names(data_dir: Path) -> list[str]:
    if not data_dir.is_dir():
        return []
    return sorted(
        entry.name
        for entry in data_dir.iterdir()
        if entry.is_dir() and entry.name not in host.SHARED_DIRS and not entry.name.startswith(".")
    )


def status_row(data_dir: Path, name: str, now: datetime) -> dict[str, object]:
    directory = host.engine_dir(data_dir, name)
    desired = host.read_desired(directory)
    requested = desired.generation if desired else None
    status = host.load_status(directory)
    reading = host.classify(status, requested if requested is not None else -1, now)
    if status is None:
        state, shown = "unknown", reading.reason
    elif reading.answer == "unavailable":
        state, shown = "stale", f"{reading.reason}; last said: {status.state}: {status.message}"
    elif reading.answer == "pending":
        state, shown = f"{status.state} (pending)", reading.reason
    else:
        state, shown = status.state, status.message
    if status is not None and status.refused:
        shown = f"request refused: {status.refused}"
    return {
        "name": name,
        "state": state,
        "answer": reading.answer,
        "requested": requested,
        "desired": desired.desired if desired else None,
        "applied": status.generation if status else None,
        "heartbeatAge": round((now - status.checked_at).total_seconds(), 1) if status else None,
        "message": shown,
        "url": status.url if status and reading.answer == "current" else None,
    }


def _cmd_status(args: argparse.Namespace) -> int:
    data_dir = data_dir_from(args.data_dir)
    names = args.names or _engine_names(data_dir)
    now = utc_now()
    rows = [status_row(data_dir, name, now) for name in names]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    header = ("NAME", "STATE", "REQ", "APPLIED", "AGE", "URL", "MESSAGE")
    table = [header] + [
        (
            str(row["name"]),
            str(row["state"]),
            "-" if row["requested"] is None else str(row["requested"]),
            "-" if row["applied"] is None else str(row["applied"]),
            "-" if row["heartbeatAge"] is None else f"{row['heartbeatAge']}s",
            str(row["url"] or "-"),
            str(row["message"]),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    for line in table:
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        print("  ".join([*cells, line[-1]]))
    return EXIT_OK


def _cmd_schemas(args: argparse.Namespace) -> int:
    out = ensure_dir(Path(args.out), mode=0o755)
    for name, schema in checked_in().items():
        write_atomic(out / name, (json.dumps(schema, indent=2) + "\n").encode(), mode=0o644)
        print(out / name)
    return EXIT_OK


def _cmd_worker(args: argparse.Namespace) -> int:
    from supervisor import logs
    from supervisor.errors import Transient
    from supervisor.protocol.files import LeaseHeld
    from supervisor.recipe.loader import load, locate
    from supervisor.recipe.schema import RecipeError
    from supervisor.worker.loop import Settings, Worker

    logs.configure()
    log = logs.get("worker")
    path = locate(args.name, args.recipe)
    settings = Settings(
        name=args.name,
        data_dir=data_dir_from(args.data_dir),
        state_dir=state_dir_from(args.state_dir, args.name),
        heartbeat=args.heartbeat or float(os.environ.get("LUCIA_HEARTBEAT_SECONDS") or 15),
        metrics_port=args.metrics_port or int(os.environ.get("LUCIA_METRICS_PORT") or 0) or None,
    )
    try:
        worker = Worker(settings, lambda: load(path))
        return worker.run()
    except RecipeError as exc:
        log.error("recipe refused", error=str(exc))
        _print_err(str(exc))
        return EXIT_CONFIG
    except LeaseHeld as exc:
        log.error("another worker holds the directory", error=str(exc))
        _print_err(str(exc))
        return EXIT_FAILED
    except Transient as exc:
        log.error("docker unavailable", error=str(exc))
        _print_err(str(exc))
        return EXIT_FAILED


def _cmd_plan(args: argparse.Namespace) -> int:
    from supervisor.memplan import overview, probe, settings
    from supervisor.memplan.ledger import Ledger
    from supervisor.recipe.loader import load, locate, recipes_dir
    from supervisor.recipe.schema import RecipeError

    try:
        machine = settings.load(Path(args.machine).expanduser() if args.machine else None)
    except settings.MachineError as exc:
        _print_err(str(exc))
        return EXIT_CONFIG
    names = args.names or sorted(path.stem for path in recipes_dir().glob("*.toml"))
    try:
        recipes = [load(locate(name)) for name in names]
    except RecipeError as exc:
        _print_err(str(exc))
        return EXIT_CONFIG
    try:
        memory = probe.measure(machine)
    except (probe.ProbeFailed, OSError) as exc:
        _print_err(f"cannot measure the memory limit: {exc}")
        return EXIT_FAILED
    # What runs holds its claim; without Docker, only starts in progress show (ledger.py).
    from supervisor.docker.runtime import Runtime
    from supervisor.errors import Transient
    from supervisor.memplan.guard import running_engines

    try:
        running = running_engines(Runtime())
    except Transient:
        running = set()
    held = Ledger.for_data_dir(data_dir_from(args.data_dir)).held(running=running)
    plan = overview.build(recipes, machine, memory, held)
    if args.json:
        print(json.dumps(overview.as_json(plan), indent=2))
    else:
        print(overview.render(plan))
    return EXIT_OK if plan.fits else EXIT_FAILED


def state_dir_from(value: str | None, name: str) -> Path:
    """The worker's private state: the argument, then LUCIA_STATE_DIR/NAME, then XDG's."""
    if value:
        return Path(value).expanduser().absolute()
    base = os.environ.get("LUCIA_STATE_DIR") or os.environ.get("XDG_STATE_HOME")
    root = Path(base).expanduser() if base else Path("~/.local/state").expanduser()
    suffix = name if os.environ.get("LUCIA_STATE_DIR") else f"lucia/{name}"
    return (root / suffix).absolute()


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {value!r}")
    return number


def _engine_name(value: str) -> str:
    try:
        return host.check_name(value)
    except host.BadName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--data-dir",
        help=f"engine data directory (env LUCIA_DATA_DIR, default {DEFAULT_DATA_DIR})",
    )
    parser = argparse.ArgumentParser(
        prog="lucia-supervisor", description="Run local LLM engines through a file protocol."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    req = sub.add_parser("request", parents=[common], help="ask for an engine to run or stop")
    req.add_argument("name", type=_engine_name)
    req.add_argument("desired", choices=["running", "stopped"])
    req.add_argument("--wait", action="store_true", help="wait for the worker's answer")
    req.add_argument("--timeout", type=_positive, default=900.0, help="seconds (default 900)")
    req.set_defaults(func=_cmd_request)

    st = sub.add_parser("status", parents=[common], help="show engines and their heartbeat")
    st.add_argument("names", nargs="*", type=_engine_name, metavar="NAME")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_status)

    wait = sub.add_parser("wait", parents=[common], help="wait for the current request's state")
    wait.add_argument("name", type=_engine_name)
    wait.add_argument("--state", required=True, choices=STATES)
    wait.add_argument("--timeout", type=_positive, default=900.0, help="seconds (default 900)")
    wait.set_defaults(func=_cmd_wait)

    work = sub.add_parser("worker", parents=[common], help="supervise one engine (privileged)")
    work.add_argument("name", type=_engine_name)
    work.add_argument("--recipe", help="recipe file (default NAME.toml in LUCIA_RECIPES_DIR)")
    work.add_argument("--state-dir", help="private state: checkout, stamps (env LUCIA_STATE_DIR)")
    work.add_argument("--heartbeat", type=_positive, help="seconds between status writes (15)")
    work.add_argument("--metrics-port", type=int, help="serve worker metrics on 127.0.0.1:PORT")
    work.set_defaults(func=_cmd_worker)

    pl = sub.add_parser("plan", parents=[common], help="print the memory plan; start nothing")
    pl.add_argument("names", nargs="*", type=_engine_name, metavar="NAME")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--machine", help="machine settings file (env LUCIA_MACHINE_FILE)")
    pl.set_defaults(func=_cmd_plan)

    sch = sub.add_parser("schemas", help="write the protocol's JSON Schemas")
    sch.add_argument("--out", required=True, metavar="DIR")
    sch.set_defaults(func=_cmd_schemas)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except (OSError, ValueError) as exc:
        _print_err(str(exc))
        return EXIT_FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
