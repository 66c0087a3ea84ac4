"""An engine's argument list read as argparse reads it, with no Docker: recipes use it too."""

from __future__ import annotations

from collections.abc import Sequence


def flag_values(args: Sequence[str], flag: str, *, many: bool = False) -> tuple[str, ...]:
    """Pure: the value(s) the last `flag` of an argument list gives, as argparse reads them:
    `--flag V`, `--flag=V` and, with `many` (nargs="+"), every value up to the next option."""
    found: tuple[str, ...] = ()
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            found = (arg[len(flag) + 1 :],)
        elif arg == flag:
            values: list[str] = []
            for value in args[index + 1 :]:
                if value.startswith("-") or (values and not many):
                    break
                values.append(value)
            found = tuple(values)
    return found
