"""The worker's side of the command line: worker (one engine's supervisor) and plan.

Both load recipes through the engine registry; plan reads the memory plan's files too. They
import their side (Docker, the engines, the memory plan) only when run, so the host's commands,
in the same program, never do.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from supervisor import paths
from supervisor.console import (
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_OK,
    Subparsers,
    engine_name,
    positive,
    print_err,
)


def _cmd_worker(args: argparse.Namespace) -> int:
    from supervisor import logs
    from supervisor.engines.loader import load
    from supervisor.errors import Transient
    from supervisor.protocol.files import LeaseHeld
    from supervisor.recipe.schema import RecipeError
    from supervisor.worker.loop import Worker, WorkerSettings

    logs.configure()
    log = logs.get("worker")
    path = paths.recipe_file(args.name, args.recipe, args.recipes_dir)
    settings = WorkerSettings(
        name=args.name,
        data_dir=paths.data_dir(args.data_dir),
        state_dir=paths.state_dir(args.state_dir, args.name),
        heartbeat=args.heartbeat or float(os.environ.get("LUCIA_HEARTBEAT_SECONDS") or 15),
        metrics_port=args.metrics_port or int(os.environ.get("LUCIA_METRICS_PORT") or 0) or None,
    )
    try:
        worker = Worker(settings, lambda: load(path))
        return worker.run()
    except RecipeError as exc:
        log.error("recipe refused", error=str(exc))
        print_err(str(exc))
        return EXIT_CONFIG
    except LeaseHeld as exc:
        log.error("another worker holds the directory", error=str(exc))
        print_err(str(exc))
        return EXIT_FAILED
    except Transient as exc:
        log.error("docker unavailable", error=str(exc))
        print_err(str(exc))
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
        print_err(str(exc))
        return EXIT_CONFIG
    recipes_dir = paths.recipes_dir(args.recipes_dir)
    names = args.names or sorted(path.stem for path in recipes_dir.glob("*.toml"))
    if not names:
        print_err(f"no recipes in {recipes_dir} (--recipes-dir, env {paths.RECIPES_ENV})")
        return EXIT_CONFIG
    try:
        recipes = [load(paths.recipe_file(name, None, args.recipes_dir)) for name in names]
    except RecipeError as exc:
        print_err(str(exc))
        return EXIT_CONFIG
    try:
        memory = probe.measure(machine)
    except (probe.ProbeFailed, OSError) as exc:
        print_err(f"cannot measure the memory limit: {exc}")
        return EXIT_FAILED
    held = overview.held_from_files(paths.data_dir(args.data_dir))
    plan = overview.build(recipes, machine, memory, held, plan_memory)
    if args.json:
        print(json.dumps(overview.as_json(plan), indent=2))
    else:
        print(overview.render(plan))
    return EXIT_OK if plan.fits else EXIT_FAILED


def add_worker(
    sub: Subparsers, common: argparse.ArgumentParser, recipes: argparse.ArgumentParser
) -> None:
    work = sub.add_parser(
        "worker", parents=[common, recipes], help="supervise one engine (privileged)"
    )
    work.add_argument("name", type=engine_name)
    work.add_argument("--recipe", help="recipe file (default NAME.toml in --recipes-dir)")
    work.add_argument("--state-dir", help="private state: checkout, stamps (env LUCIA_STATE_DIR)")
    work.add_argument("--heartbeat", type=positive, help="seconds between status writes (15)")
    work.add_argument("--metrics-port", type=int, help="serve worker metrics on 127.0.0.1:PORT")
    work.set_defaults(func=_cmd_worker)


def add_plan(
    sub: Subparsers, common: argparse.ArgumentParser, recipes: argparse.ArgumentParser
) -> None:
    pl = sub.add_parser(
        "plan", parents=[common, recipes], help="print the memory plan; start nothing"
    )
    pl.add_argument("names", nargs="*", type=engine_name, metavar="NAME")
    pl.add_argument("--json", action="store_true")
    pl.add_argument("--machine", help="machine settings file (env LUCIA_MACHINE_FILE)")
    pl.set_defaults(func=_cmd_plan)
