"""What /proc/meminfo says of the machine's memory: MemTotal and MemAvailable, in bytes.

The memory plan measures its host limit from it, and the host's page shows it; both read it
here (kB there, bytes here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from supervisor.protocol.files import read_text

MEMINFO: Final = Path("/proc/meminfo")
MAX_MEMINFO: Final = 1024 * 1024


class MeminfoUnreadable(ValueError):
    """/proc/meminfo's text does not say MemTotal and MemAvailable; str() says what is wrong."""


def parse_meminfo(text: str) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes from /proc/meminfo's text."""
    found: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in {"MemTotal", "MemAvailable"}:
            number, _, unit = rest.strip().partition(" ")
            if not number.isdigit() or unit not in {"kB", ""}:
                raise MeminfoUnreadable(f"/proc/meminfo: cannot read {key}: {rest.strip()!r}")
            found[key] = int(number) * (1024 if unit == "kB" else 1)
    if len(found) != 2:
        raise MeminfoUnreadable("/proc/meminfo: MemTotal or MemAvailable is missing")
    return found["MemTotal"], found["MemAvailable"]


def read_meminfo(path: Path = MEMINFO) -> tuple[int, int]:
    """(MemTotal, MemAvailable) from the file; OSError or FileRefused when it cannot be read."""
    return parse_meminfo(read_text(path, limit=MAX_MEMINFO))
