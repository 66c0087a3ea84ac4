"""What the page shows besides the engines and the keys, each from a source given to it.

A source answers a JSON-ready dict, or None when it has nothing to say: the page then shows
the section as "not available". The record (traffic, and each key's last use and spending:
traffic.py) and the model library (its downloads: models.py) plug in here; the service gives
them (traffic.record_sources), a source left out says "not available".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class SectionSource(Protocol):
    def read(self) -> dict[str, Any] | None:
        """The section's data now, or None when it is not available; called off the loop."""
        ...


class KeyUseSource(Protocol):
    def read(self) -> dict[str, dict[str, Any]] | None:
        """Per key id: its last use and the day's spending, or None when nothing records it."""
        ...


class Nothing:
    """A source that is not wired: the section says "not available"."""

    def read(self) -> None:
        return None


@dataclass(frozen=True)
class Sources:
    """The page's sources; memory is given by the gateway (see memory.py)."""

    memory: SectionSource = field(default_factory=Nothing)
    models: SectionSource = field(default_factory=Nothing)
    traffic: SectionSource = field(default_factory=Nothing)
    key_use: KeyUseSource = field(default_factory=Nothing)


def section(source: SectionSource | KeyUseSource) -> dict[str, Any]:
    """A source's answer as the page reads it: `available` and, when it is, `data`."""
    data = source.read()
    return {"available": False} if data is None else {"available": True, "data": data}
