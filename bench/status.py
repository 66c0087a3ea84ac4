"""The bench's view of status.json: a tight poll that verifies each new version by content."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

Doc = dict[str, Any]


class Timeout(RuntimeError):
    pass


def epoch(iso: str) -> float:
    """An ISO-8601 time from status.json ('...Z') as Unix seconds."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def floor_ms(seconds: float) -> float:
    """checkedAt is written truncated to the millisecond: compare against a truncated clock."""
    return math.floor(seconds * 1000) / 1000


def read_json(path: Path) -> Doc | None:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class StatusWatch:
    """Detects a new status.json by a tight poll: one stat() a millisecond, and on a new inode,
    mtime or size the file is read and parsed, so each answer is verified by content.

    The worker replaces the file atomically, so every write is a new inode. The detection time
    is at most one poll interval (+ the sleep's overshoot, ~0.1 ms) after the rename.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.doc: Doc | None = None
        self._sig: tuple[int, int, int] | None = None

    def poll(self) -> bool:
        """True when a new version of the file was read."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        sig = (st.st_ino, st.st_mtime_ns, st.st_size)
        if sig == self._sig:
            return False
        doc = read_json(self.path)
        if doc is None:  # vanished between stat and read: try again next poll
            return False
        self._sig, self.doc = sig, doc
        return True

    def wait(
        self, check: Callable[[Doc], bool], timeout: float, interval: float = 0.001
    ) -> tuple[Doc, float]:
        """Poll until check(status) holds; the status and the perf_counter() when it was seen."""
        deadline = time.perf_counter() + timeout
        self.poll()
        while True:
            if self.doc is not None and check(self.doc):
                return self.doc, time.perf_counter()
            if time.perf_counter() > deadline:
                raise Timeout(f"{self.path}: timed out after {timeout:g}s; last: {self.doc}")
            time.sleep(interval)
            self.poll()


def answers(generation: int, *states: str) -> Callable[[Doc], bool]:
    def check(doc: Doc) -> bool:
        return doc.get("generation") == generation and (not states or doc.get("state") in states)

    return check
