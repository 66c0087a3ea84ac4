"""What both sides of the command line share: its exit codes, its error line, its argument types.

The host's commands (supervisor/host/commands/) and the worker's (supervisor/worker/commands.py)
print and exit alike through these; supervisor/cli.py puts the two sides in one parser.
"""

from __future__ import annotations

import argparse
import sys
from typing import Final, TypeAlias

from supervisor.protocol.layout import BadName, check_name

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_UNANSWERED: Final = 3
EXIT_CONFIG: Final = 78  # EX_CONFIG: restarting will not help until the file is fixed

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def print_err(message: str) -> None:
    """One line on stderr, named for the program."""
    print(f"lucia-supervisor: {message}", file=sys.stderr)


def positive(value: str) -> float:
    """A positive number of seconds, or ArgumentTypeError saying what is wrong."""
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {value!r}")
    return number


def engine_name(value: str) -> str:
    """An engine's name by the protocol's rule, or ArgumentTypeError saying why not."""
    try:
        return check_name(value)
    except BadName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
