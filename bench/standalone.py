"""What the standalone benchmark scripts share: a timed call, the machine, file system, tables."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def timed(fn: Callable[[], object]) -> float:
    """The seconds one call of `fn` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def machine() -> str:
    """One line: architecture, CPUs, kernel and Python."""
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def filesystem(path: Path) -> str:
    """The type of the file system `path` is on (`ext2/ext3`, `tmpfs`, ...), or nothing."""
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=False
    ).stdout.strip()


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    """Print `rows` under `header`, each column as wide as its widest cell, then a blank line."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths), *rows]:
        print("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print()
