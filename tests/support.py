"""Small helpers and inputs shared by several test modules."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# the smallest valid tensorfold recipe
MINIMAL_RECIPE = """
name = "x"
engine = "tensorfold"
model = "m"
[source]
repository = "file:///r"
commit = "0123456789abcdef0123456789abcdef01234567"
[image]
tag = "img:1"
[grammar]
requirement = "xgrammar>=0.2.8,<0.3"
modules = ["xgrammar"]
[run]
port = 8888
"""


def within(seconds: float, fn: Callable[[], T]) -> T:
    """Run fn in a daemon thread; fail (instead of hanging) if it has not returned in time."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still blocked after {seconds}s"
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]
