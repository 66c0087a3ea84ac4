"""lucia-supervisor: the command line, the host's commands and the worker's in one parser.

The host's commands (supervisor/host/commands/) only read and write files; the worker's
(supervisor/worker/commands.py) import Docker, the engines and the memory plan when run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from supervisor import paths
from supervisor.console import EXIT_FAILED, EXIT_OK, print_err
from supervisor.host.commands import engines, gateway, models
from supervisor.protocol.files import ensure_dir, write_atomic
from supervisor.schemas import checked_in
from supervisor.version import version
from supervisor.worker import commands as worker

DEFAULT_DATA_DIR: Final = "~/.local/share/lucia/host/data"


def _cmd_schemas(args: argparse.Namespace) -> int:
    out = ensure_dir(Path(args.out), mode=0o755)
    for name, schema in checked_in().items():
        write_atomic(out / name, (json.dumps(schema, indent=2) + "\n").encode(), mode=0o644)
        print(out / name)
    return EXIT_OK


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

    engines.add_engines(sub, common, recipes)
    worker.add_worker(sub, common, recipes)
    gateway.add_gateway(sub, common)
    worker.add_plan(sub, common, recipes)
    gateway.add_keys(sub, common)
    gateway.add_usage(sub, common)
    models.add_models(sub)

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
        print_err(str(exc))
        return EXIT_FAILED
    return code


if __name__ == "__main__":
    sys.exit(main())
