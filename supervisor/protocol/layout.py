"""Where the protocol's files are: the data directory's engine folders and their documents.

The host writes <data>/<name>/desired.json and the worker <data>/<name>/status.json; both sides
name them from here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

DESIRED: Final = "desired.json"
STATUS: Final = "status.json"
_NAME = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
# directories of the data directory that every worker shares, or the host keeps (the gateway's
# record, the issued keys): never an engine's name
SHARED_DIRS: Final = frozenset({"telemetry", "memory", "record", "inference-keys"})


class BadName(ValueError):
    pass


def check_name(name: str) -> str:
    """Engine names become directory, unit and container names: keep them boring."""
    if not _NAME.fullmatch(name) or ".." in name:
        raise BadName(
            f"invalid engine name {name!r}: use lowercase letters, digits, '-', '_' and '.', "
            "starting with a letter or digit, at most 63 characters"
        )
    if name in SHARED_DIRS:
        raise BadName(f"invalid engine name {name!r}: the data directory's {name}/ is shared")
    return name


def engine_dir(data_dir: Path, name: str) -> Path:
    return data_dir / check_name(name)
