"""Secret values (tokens) known to this process, masked wherever text leaves it: the status
message, the journal."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

MASK: Final = "***"
_MIN_LENGTH: Final = 4  # shorter values would mask ordinary words
_values: set[str] = set()


def register(values: Iterable[str]) -> None:
    _values.update(value for value in values if len(value) >= _MIN_LENGTH)


def redact(text: str) -> str:
    for value in _values:
        if value in text:
            text = text.replace(value, MASK)
    return text
