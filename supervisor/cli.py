"""lucia-supervisor: the command line. Host commands only read and write files."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Final

from supervisor import paths
from supervisor.host import commands, waiting
from supervisor.host import protocol as host
from supervisor.host.library import commands as library_commands
from supervisor.protocol.documents import STATES, DesiredFile, utc_now
from supervisor.protocol.files import ensure_dir, write_atomic
from supervisor.protocol.layout import DESIRED, SHARED_DIRS, STATUS, BadName, check_name, engine_dir
from supervisor.protocol.reads import load_status, read_desired
from supervisor.schemas import checked_in
from supervisor.version import version

EXIT_OK: Final = waiting.EXIT_OK
EXIT_FAILED: Final = waiting.EXIT_FAILED
EXIT_USAGE: Final = 2
EXIT_UNANSWERED: Final = waiting.EXIT_UNANSWERED
EXIT_CONFIG: Final = waiting.EXIT_CONFIG
GATEWAY: Final = "gateway"  # lucia-gateway.service: the gateway's unit, never an engine's
DEFAULT_DATA_DIR: Final = "~/.local/share/lucia/host/data"
# A first download of a large checkpoint (125 GB) takes hours; a stale worker ends a wait anyway.
DEFAULT_TIMEOUT: Final = 6 * 3600.0


def data_dir_from(value: str | None) -> Path:
    """The data directory (paths.data_dir: the argument, LUCIA_DATA_DIR, then install.sh's)."""
    return paths.data_dir(value)


def _print_err(message: str) -> None:
    print(f"lucia-supervisor: {message}", file=sys.stderr)


def _wait_command(name: str, state: str, data_dir: Path) -> str:
    where = "" if data_dir == paths.data_dir(None) else f" --data-dir {data_dir}"
    return f"lucia-supervisor wait {name} --state {state}{where}"


def known_engines(data_dir: Path, recipes: Path) -> set[str]:
    """Names with a recipe, a lucia-NAME unit (install.sh's) or a status.json."""
    names = {path.stem for path in recipes.glob("*.toml")}
    units = paths.units_dir()
    names |= {path.name[len("lucia-") : -len(".service")] for path in units.glob("lucia-*.service")}
    names.discard(GATEWAY)  # lucia-gateway.service is the gateway's, no engine's
    names |= {name for name in _engine_names(data_dir) if (data_dir / name / STATUS).is_file()}
    return names


def unknown_engine(name: str, data_dir: Path, recipes: Path) -> str | None:
    """Why name is no engine of this machine, in one line; None when it is one."""
    recipe, unit = recipes / f"{name}.toml", paths.unit_file(name)
    status = engine_dir(data_dir, name) / STATUS
    if recipe.is_file() or (unit.is_file() and name != GATEWAY) or status.is_file():
        return None
    known = ", ".join(sorted(known_engines(data_dir, recipes))) or "none"
    return (
        f"no engine named {name}: no recipe {recipe}, no unit {unit} and no status {status} "
        f"(engines here: {known}); if the name is right, install its recipe "
        f"(install.sh --recipe FILE) and start its worker (systemctl --user start lucia-{name}), "
        "or pass --create to request it anyway"
    )


def _cmd_request(args: argparse.Namespace) -> int:
    data_dir = data_dir_from(args.data_dir)
    if not args.create:
        problem = unknown_engine(args.name, data_dir, paths.recipes_dir(args.recipes_dir))
        if problem is not None:
            _print_err(problem)
            return EXIT_USAGE
    generation = host.request(data_dir, args.name, args.desired, "operator")
    print(generation, flush=True)
    if not args.wait:
        return EXIT_OK
    return waiting.await_state(
        data_dir, args.name, generation, args.desired, args.timeout,
        keep_waiting=_wait_command(args.name, args.desired, data_dir),
    )  # fmt: skip


def _cmd_wait(args: argparse.Namespace) -> int:
    data_dir = data_dir_from(args.data_dir)
    directory = engine_dir(data_dir, args.name)
    desired = read_desired(directory)
    if desired is None:
        _print_err(f"no valid request in {directory / DESIRED}; use 'request' first")
        return EXIT_UNANSWERED
    return waiting.await_state(
        data_dir, args.name, desired.generation, args.state, args.timeout,
        keep_waiting=_wait_command(args.name, args.state, data_dir),
    )  # fmt: skip


def _engine_names(data_dir: Path) -> list[str]:
    if not data_dir.is_dir():
        return []
    return sorted(
        entry.name
        for entry in data_dir.iterdir()
        if entry.is_dir() and entry.name not in SHARED_DIRS and not entry.name.startswith(".")
    )


def status_row(data_dir: Path, name: str, now: datetime) -> dict[str, object]:
    directory = engine_dir(data_dir, name)
    desired = read_desired(directory)
    requested = desired.generation if desired else None
    status = load_status(directory)
    reading = host.classify(status, requested if requested is not None else -1, now)
    if status is None:
        state, shown = "unknown", f"{reading.reason} (systemctl --user start lucia-{name})"
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
        # who wrote the request (operator, gateway; null: an older host's) and when
        "requestedBy": desired.requested_by if desired else None,
        "requestedAt": said_at(desired),
        "applied": status.generation if status else None,
        "heartbeatAge": round((now - status.checked_at).total_seconds(), 1) if status else None,
        "message": shown,
        "url": status.url if status and reading.answer == "current" else None,
        "refused": status.refused if status else None,
        "workerVersion": status.worker_version if status else None,
    }


def said_at(desired: DesiredFile | None) -> str | None:
    """The request's requestedAt as desired.json says it, or None."""
    if desired is None or desired.requested_at is None:
        return None
    return str(desired.model_dump(mode="json", by_alias=True)["requestedAt"])


def row_code(row: dict[str, object]) -> int:
    """0: the row answers its request and has not failed; 1: failed or its request refused;
    3: stale, pending or never answered (the codes of request --wait)."""
    if row["refused"] or (row["answer"] == "current" and row["state"] == "failed"):
        return EXIT_FAILED
    return EXIT_OK if row["answer"] == "current" else EXIT_UNANSWERED


def status_code(rows: Sequence[dict[str, object]]) -> int:
    """A failure outranks an unanswered engine; nothing wrong is 0."""
    codes = {row_code(row) for row in rows}
    return next((code for code in (EXIT_FAILED, EXIT_UNANSWERED) if code in codes), EXIT_OK)


def _cmd_status(args: argparse.Namespace) -> int:
    data_dir = data_dir_from(args.data_dir)
    names = args.names or _engine_names(data_dir)
    now = utc_now()
    rows = [status_row(data_dir, name, now) for name in names]
    if not rows:
        missing = "" if data_dir.is_dir() else " (it does not exist)"
        print(f"no engines in {data_dir}{missing}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(rows, indent=2))
        return status_code(rows)
    if not rows:
        return EXIT_OK
    header = ("NAME", "STATE", "REQ", "BY", "APPLIED", "AGE", "URL", "MESSAGE")
    table = [header] + [
        (
            str(row["name"]),
            str(row["state"]),
            "-" if row["requested"] is None else str(row["requested"]),
            str(row["requestedBy"] or "-"),
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
    return status_code(rows)


def _cmd_schemas(args: argparse.Namespace) -> int:
    out = ensure_dir(Path(args.out), mode=0o755)
    for name, schema in checked_in().items():
        write_atomic(out / name, (json.dumps(schema, indent=2) + "\n").encode(), mode=0o644)
        print(out / name)
    return EXIT_OK


def _cmd_worker(args: argparse.Namespace) -> int:
    from supervisor import logs
    from supervisor.engines.loader import load
    from supervisor.errors import Transient
    from supervisor.protocol.files import LeaseHeld
    from supervisor.recipe.schema import RecipeError
    from supervisor.worker.loop import Settings, Worker

    logs.configure()
    log = logs.get("worker")
    path = paths.recipe_file(args.name, args.recipe, args.recipes_dir)
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
    """Reads files only (a host has no Docker): recipes, machine settings, ledger, statuses."""
    from supervisor.engines.loader import load
    from supervisor.engines.registry import plan_memory
    from supervisor.memplan import overview, probe, settings
    from supervisor.recipe.schema import RecipeError

    try:
        machine = settings.load(Path(args.machine).expanduser() if args.machine else None)
    except settings.MachineError as exc:
        _print_err(str(exc))
        return EXIT_CONFIG
    recipes_dir = paths.recipes_dir(args.recipes_dir)
    names = args.names or sorted(path.stem for path in recipes_dir.glob("*.toml"))
    if not names:
        _print_err(f"no recipes in {recipes_dir} (--recipes-dir, env {paths.RECIPES_ENV})")
        return EXIT_CONFIG
    try:
        recipes = [load(paths.recipe_file(name, None, args.recipes_dir)) for name in names]
    except RecipeError as exc:
        _print_err(str(exc))
        return EXIT_CONFIG
    try:
        memory = probe.measure(machine)
    except (probe.ProbeFailed, OSError) as exc:
        _print_err(f"cannot measure the memory limit: {exc}")
        return EXIT_FAILED
    held = overview.held_from_files(data_dir_from(args.data_dir))
    plan = overview.build(recipes, machine, memory, held, plan_memory)
    if args.json:
        print(json.dumps(overview.as_json(plan), indent=2))
    else:
        print(overview.render(plan))
    return EXIT_OK if plan.fits else EXIT_FAILED


def state_dir_from(value: str | None, name: str) -> Path:
    """The worker's private state (paths.state_dir)."""
    return paths.state_dir(value, name)


def _positive(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {value!r}")
    return number


def _engine_name(value: str) -> str:
    try:
        return check_name(value)
    except BadName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--data-dir",
        help=f"engine data directory (env LUCIA_DATA_DIR, default {DEFAULT_DATA_DIR})",
    )
    recipes = argparse.ArgumentParser(add_help=False)
    recipes.add_argument(
        "--recipes-dir",
        metavar="DIR",
        help=f"recipe files (env {paths.RECIPES_ENV}, default install.sh's "
        "~/.local/share/lucia/recipes, else the source tree's recipes/)",
    )
    parser = argparse.ArgumentParser(
        prog="lucia-supervisor", description="Run local LLM engines through a file protocol."
    )
    parser.add_argument("--version", action="version", version=f"lucia-supervisor {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    timeout = f"seconds (default {DEFAULT_TIMEOUT:g}: a first download takes hours)"
    req = sub.add_parser(
        "request", parents=[common, recipes], help="ask for an engine to run or stop"
    )
    req.add_argument("name", type=_engine_name)
    req.add_argument("desired", choices=["running", "stopped"])
    req.add_argument("--wait", action="store_true", help="wait for the worker's answer")
    req.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT, help=timeout)
    req.add_argument(
        "--create",
        action="store_true",
        help="request an engine that has no recipe, unit or status yet",
    )
    req.set_defaults(func=_cmd_request)

    st = sub.add_parser("status", parents=[common], help="show engines and their heartbeat")
    st.add_argument("names", nargs="*", type=_engine_name, metavar="NAME")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_cmd_status)

    wait = sub.add_parser("wait", parents=[common], help="wait for the current request's state")
    wait.add_argument("name", type=_engine_name)
    wait.add_argument("--state", required=True, choices=STATES)
    wait.add_argument("--timeout", type=_positive, default=DEFAULT_TIMEOUT, help=timeout)
    wait.set_defaults(func=_cmd_wait)

    work = sub.add_parser(
        "worker", parents=[common, recipes], help="supervise one engine (privileged)"
    )
    work.add_argument("name", type=_engine_name)
    work.add_argument("--recipe", help="recipe file (default NAME.toml in --recipes-dir)")
    work.add_argument("--state-dir", help="private state: checkout, stamps (env LUCIA_STATE_DIR)")
    work.add_argument("--heartbeat", type=_positive, help="seconds between status writes (15)")
    work.add_argument("--metrics-port", type=int, help="serve worker metrics on 127.0.0.1:PORT")
    work.set_defaults(func=_cmd_worker)

    commands.add_gateway(sub, common)

    pl = sub.add_parser(
        "plan", parents=[common, recipes], help="print the memory plan; start nothing"
    )
    pl.add_argument("names", nargs="*", type=_engine_name, metavar="NAME")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--machine", help="machine settings file (env LUCIA_MACHINE_FILE)")
    pl.set_defaults(func=_cmd_plan)

    commands.add_keys(sub, common)
    commands.add_usage(sub, common)
    library_commands.add_models(sub)

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
