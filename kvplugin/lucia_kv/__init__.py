"""lucia-kv-tiers: a KV-cache block store over shared-memory, NVMe and HDD tiers, for vLLM."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "lucia-kv-tiers"


def version() -> str:
    """The plugin's version: pyproject.toml's beside this package (a checkout, or the copy the
    supervisor ships), else the metadata the tier image installed with it. The files beside
    come first, so another installed copy's metadata never names the version of these files:
    the supervisor reads the same pyproject.toml, and namespaces are bound to the version."""
    source = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        with source.open("rb") as handle:
            project = tomllib.load(handle).get("project", {})
    except FileNotFoundError:
        return metadata.version(DISTRIBUTION)
    if project.get("name") != DISTRIBUTION or not isinstance(project.get("version"), str):
        return metadata.version(DISTRIBUTION)  # another project's file beside site-packages
    found: str = project["version"]
    return found
