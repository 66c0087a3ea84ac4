"""Strict JSON for the protocol's files, and a validation error as one line.

What a lenient parser would accept is refused: a BOM, duplicate keys, NaN and Infinity, numbers
too long for int(). A validation error becomes one line naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError


class InvalidDocument(ValueError):
    """A protocol file whose content breaks the contract; str() is one line naming the problem."""


_MAX_DIGITS: Final = 1000  # longer numbers are kept out of int() (it refuses beyond 4300)
_SHOWN: Final = 60  # characters of a key or value quoted in a message


def _clip(text: str) -> str:
    """A key or value for a one-line message: escaped (no control characters) and short."""
    escaped = repr(text[:_SHOWN])[1:-1]
    return escaped + ("…" if len(text) > _SHOWN else "")


def _shown(text: str) -> str:
    return repr(text[:_SHOWN]) + ("…" if len(text) > _SHOWN else "")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise InvalidDocument(f"duplicate key {_shown(key)}")
        seen[key] = value
    return seen


def _no_constants(name: str) -> Any:
    raise InvalidDocument(f"{name} is not valid JSON")


class _TooLong:
    """A number with more digits than int() takes: no valid value anywhere in the contract."""

    def __init__(self, digits: str) -> None:
        self.digits = len(digits)


@dataclass(frozen=True)
class Checked:
    value: Any  # the parsed document; numbers too long for int() stand in as _TooLong
    too_long: bool  # whether there is such a number


def check_json(text: str) -> Checked:
    """Reject what a lenient parser would accept: a BOM, duplicate keys, NaN and Infinity."""
    if text.startswith("\ufeff"):
        raise InvalidDocument("starts with a byte-order mark; save it as plain UTF-8")
    if not text.strip():
        raise InvalidDocument("is empty")
    too_long: list[_TooLong] = []

    def bounded_int(digits: str) -> int | _TooLong:
        if len(digits) <= _MAX_DIGITS:
            return int(digits)
        too_long.append(_TooLong(digits))
        return too_long[-1]

    try:
        value = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
            parse_int=bounded_int,
        )
    except json.JSONDecodeError as exc:
        raise InvalidDocument(f"is not valid JSON: {exc.msg} at line {exc.lineno}") from None
    except RecursionError:
        raise InvalidDocument("is not valid JSON here: nested too deeply") from None
    return Checked(value, bool(too_long))


def first_error(exc: ValidationError) -> str:
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(part) for part in err["loc"]) if err["loc"] else "document"
    if err["type"] == "extra_forbidden":
        return f"unknown field {_shown(where)}"
    if err["type"] == "missing":
        return f"missing field {_shown(where)}"
    where = _clip(where)
    given = err.get("input")
    shown = json.dumps(given)[:60] if isinstance(given, str | int | float | bool) else None
    detail = err["msg"][0].lower() + err["msg"][1:]
    return f"{where}: {detail}" + (f" (got {shown})" if shown is not None else "")
