"""`lucia-supervisor status --fleet`: every machine's engines, as the fleet's catalog holds them.

It reads the gateway's settings (`--settings`, else the gateway's own default place) for the
`[record] dsn` the catalog is in and the `[fleet] stale_s` bound, reads the catalog once, and
lists each machine's engines: state, models, running and waiting, when the machine was last
heard from, and whether it is stale. Exit status: 0 every machine fresh, 3 a machine stale (as
`status` says of a stale engine), 1 the database unreachable, 78 settings that name no fleet.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from supervisor.console import EXIT_CONFIG, EXIT_FAILED, EXIT_OK, EXIT_UNANSWERED, print_err
from supervisor.protocol.documents import utc_now

if TYPE_CHECKING:
    from supervisor.host.fleet.rows import Machine

_UNPRINTABLE: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")
WAIT_S: Final = 5.0  # a connection, then the read, each within it


def cmd_fleet_status(args: argparse.Namespace) -> int:
    from supervisor.host.fleet.catalog import listing, snapshot  # noqa: PLC0415 - psycopg
    from supervisor.host.gateway import settings as gateway_settings  # noqa: PLC0415
    from supervisor.host.record import database  # noqa: PLC0415

    try:
        settings = gateway_settings.load(args.settings)
    except gateway_settings.SettingsError as exc:
        print_err(str(exc))
        return EXIT_CONFIG
    path, _ = gateway_settings.settings_file(args.settings)
    if not settings.fleet.on or settings.record.dsn is None:
        print_err(
            f"the fleet is off in {path}: [fleet] machine is not set (a gateway in a fleet "
            "names its machine, and its [record] dsn holds the fleet's catalog)"
        )
        return EXIT_CONFIG
    where = database.safe_dsn(settings.record.dsn)
    try:
        found = asyncio.run(snapshot(settings.record.dsn, WAIT_S))
    except TimeoutError:
        print_err(f"the fleet's catalog ({where}): PostgreSQL did not answer in {2 * WAIT_S:g} s")
        return EXIT_FAILED
    except database.failures() as exc:
        print_err(f"the fleet's catalog ({where}): {database.one_line(exc)}")
        return EXIT_FAILED
    now = utc_now()
    machines = [
        shown(machine, now)
        for machine in listing(found or [], now, settings.fleet.stale_s)
        if not args.names or any(row.engine in args.names for row in machine.engines)
    ]
    if not machines:
        said = "no machine" if found is not None else "no gateway has made the catalog yet"
        print(
            f"the fleet's catalog ({where}): {said}", file=sys.stderr if args.json else sys.stdout
        )
    if args.json:
        print(json.dumps(machines, indent=2))
    else:
        print_table(machines, args.names)
    return EXIT_UNANSWERED if any(machine["stale"] for machine in machines) else EXIT_OK


def shown(machine: Machine, now: datetime) -> dict[str, Any]:
    """Pure: one machine of the catalog as `--json` says it."""
    return {
        "machine": machine.name,
        "url": machine.url,
        "heardAgo": round(max(0.0, (now - machine.heard).total_seconds()), 1),
        "stale": machine.stale,
        "engines": [
            {
                "engine": row.engine,
                "state": row.state,
                "models": list(row.models),
                "capabilities": {model: list(caps) for model, caps in row.declared.items()},
                "running": row.running,
                "waiting": row.waiting,
                "slots": row.slots,
                "build": row.build,
                "weightsRevision": row.weights,
                "fits": row.fits,
                "plan": row.plan,
                "stoppedByOperator": row.stopped_by_operator,
            }
            for row in machine.engines
        ],
    }


def print_table(machines: list[dict[str, Any]], names: list[str]) -> None:
    header = ("MACHINE", "ENGINE", "STATE", "RUN/WAIT", "HEARD", "MODELS")
    table = [header]
    for machine in machines:
        heard = f"{machine['heardAgo']:.0f}s ago" + (" (stale)" if machine["stale"] else "")
        engines = [e for e in machine["engines"] if not names or e["engine"] in names]
        if not engines:
            table.append((machine["machine"], "-", "-", "-", heard, "-"))
        for engine in engines:
            state = engine["state"] + (" (operator)" if engine["stoppedByOperator"] else "")
            counts = f"{engine['running']}/{engine['waiting']}"
            models = ", ".join(engine["models"]) or "-"
            table.append((machine["machine"], engine["engine"], state, counts, heard, models))
    cells = [[printable(cell) for cell in line] for line in table]
    widths = [max(len(line[i]) for line in cells) for i in range(len(header) - 1)]
    for line in cells:
        padded = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        print("  ".join([*padded, line[-1]]))


def printable(text: str) -> str:
    """Pure: a catalog's string as a terminal shows it: control characters as `?`, a lone
    surrogate escaped (another machine wrote it: it is data, never a terminal's command)."""
    return _UNPRINTABLE.sub("?", text).encode("utf-8", "backslashreplace").decode()
