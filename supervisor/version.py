"""The package's version, from its installed metadata: what --version and status.json say."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as distribution_version
from typing import Final

DISTRIBUTION: Final = "lucia-supervisor"


@cache
def version() -> str:
    """The installed distribution's version; "unknown" when run from a tree never installed."""
    try:
        return distribution_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"
