"""The engines' commands: request, status and wait, through the files of the protocol only.

request writes desired.json (refusing a name this machine has no engine of, unless --create),
status reads each engine's request and status.json, and wait follows the current request until
its status answers it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Final

from supervisor import paths
from supervisor.console import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNANSWERED,
    EXIT_USAGE,
    Subparsers,
    engine_name,
    positive,
    print_err,
)
from supervisor.host import protocol as host
from supervisor.host import waiting
from supervisor.protocol.documents import STATES, DesiredFile, utc_now
from supervisor.protocol.layout import DESIRED, SHARED_DIRS, STATUS, engine_dir
from supervisor.protocol.reads import load_status, read_desired

GATEWAY: Final = "gateway"  # lucia-gateway.service: the gateway's unit, never an engine's
# A first download of a large checkpoint (125 GB) takes hours; a stale worker ends a wait anyway.
DEFAULT_TIMEOUT: Final = 6 * 3600.0


def _wait_command(name: str, state: str, data_dir: Path) -> str:
    where = "" if data_dir == paths.data_dir(None) else f" --data-dir {data_dir}"
    return f"lucia-supervisor wait {name} --state {state}{where}"


def known_engines(data_dir: Path, recipes: Path) -> set[str]:
    """Names with a recipe, a lucia-NAME unit (install.sh's) or a status.json."""
    names = {path.stem for path in recipes.glob("*.toml")}
    units = paths.units_dir()
    names |= {path.name[len("lucia-") : -len(".service")] for path in units.glob("lucia-*.service")}
    names.discard(GATEWAY)  # lucia-gateway.service is the gateway's, no engine's
    names |= {name for name in engine_names(data_dir) if (data_dir / name / STATUS).is_file()}
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
    data_dir = paths.data_dir(args.data_dir)
    if not args.create:
        problem = unknown_engine(args.name, data_dir, paths.recipes_dir(args.recipes_dir))
        if problem is not None:
            print_err(problem)
            return EXIT_USAGE
    generation = host.request(data_dir, args.name, args.desired, "operator")
    print(generation, flush=True)
    if not args.wait:
        return EXIT_OK
    return waiting.await_state(
        data_dir,
        args.name,
        generation,
        args.desired,
        args.timeout,
        keep_waiting=_wait_command(args.name, args.desired, data_dir),
    )


def _cmd_wait(args: argparse.Namespace) -> int:
    data_dir = paths.data_dir(args.data_dir)
    directory = engine_dir(data_dir, args.name)
    desired = read_desired(directory)
    if desired is None:
        print_err(f"no valid request in {directory / DESIRED}; use 'request' first")
        return EXIT_UNANSWERED
    return waiting.await_state(
        data_dir,
        args.name,
        desired.generation,
        args.state,
        args.timeout,
        keep_waiting=_wait_command(args.name, args.state, data_dir),
    )


def engine_names(data_dir: Path) -> list[str]:
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
    if args.fleet:
        from supervisor.host.commands.fleet import cmd_fleet_status  # noqa: PLC0415

        return cmd_fleet_status(args)
    data_dir = paths.data_dir(args.data_dir)
    names = args.names or engine_names(data_dir)
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


def add_engines(
    sub: Subparsers, common: argparse.ArgumentParser, recipes: argparse.ArgumentParser
) -> None:
    timeout = f"seconds (default {DEFAULT_TIMEOUT:g}: a first download takes hours)"
    req = sub.add_parser(
        "request", parents=[common, recipes], help="ask for an engine to run or stop"
    )
    req.add_argument("name", type=engine_name)
    req.add_argument("desired", choices=["running", "stopped"])
    req.add_argument("--wait", action="store_true", help="wait for the worker's answer")
    req.add_argument("--timeout", type=positive, default=DEFAULT_TIMEOUT, help=timeout)
    req.add_argument(
        "--create",
        action="store_true",
        help="request an engine that has no recipe, unit or status yet",
    )
    req.set_defaults(func=_cmd_request)

    st = sub.add_parser("status", parents=[common], help="show engines and their heartbeat")
    st.add_argument("names", nargs="*", type=engine_name, metavar="NAME")
    st.add_argument("--json", action="store_true")
    st.add_argument(
        "--fleet",
        action="store_true",
        help="every machine's engines, from the fleet's catalog (the gateway's [record] dsn)",
    )
    st.add_argument(
        "--settings",
        metavar="PATH",
        help="with --fleet: the gateway's settings file (env LUCIA_GATEWAY_SETTINGS, default "
        "~/.config/lucia/gateway.toml)",
    )
    st.set_defaults(func=_cmd_status)

    wait = sub.add_parser("wait", parents=[common], help="wait for the current request's state")
    wait.add_argument("name", type=engine_name)
    wait.add_argument("--state", required=True, choices=STATES)
    wait.add_argument("--timeout", type=positive, default=DEFAULT_TIMEOUT, help=timeout)
    wait.set_defaults(func=_cmd_wait)
