"""The code and its formatter agree: `ruff format --check` finds nothing to change in the tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_formatter_changes_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"not as ruff formats it:\n{done.stdout}{done.stderr}"
