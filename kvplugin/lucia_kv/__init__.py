"""lucia-kv-tiers: a KV-cache block store over shared-memory, NVMe and HDD tiers, for vLLM."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "lucia-kv-tiers"


def version() -> str:
    """The plugin's version from its package metadata (or, in a source tree, its pyproject)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        source = Path(__file__).resolve().parents[1] / "pyproject.toml"
        with source.open("rb") as handle:
            found: str = tomllib.load(handle)["project"]["version"]
        return found
