"""What the conformance suite needs to drive one engine kind, and the deaths drivers share.

Each EngineKind names its driver module (`conformance`): a module with `kind(make_engine,
request) -> Kind`. The suite runs every case once per registered kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.fixtures import Engine


@dataclass(frozen=True)
class Kind:
    """How to drive one engine kind through the common cases."""

    name: str
    make: Callable[..., Engine]
    slow_step: Callable[[int], tuple[dict[str, Any], str]]  # knobs for a long step, and its text
    slow_ready: Callable[[int], tuple[dict[str, Any], str]]  # knobs for a slow load, and its text
    change_image: Callable[[Engine], None]  # make the engine's image another one
    die: Callable[[Any], tuple[str, str]]  # end the container: its exit text, a logged text
    image: Callable[[Engine], str]  # the image status.json names while it runs


def dies_with_3_saying(logged: str) -> Callable[[Any], tuple[str, str]]:
    """The stand-in's /tmp/die: it exits with 3, logging a line with `logged` in it."""

    def die(container: Any) -> tuple[str, str]:
        container.exec_run(["sh", "-c", "echo 3 > /tmp/die"])
        return "exited with code 3", logged

    return die


def killed(container: Any) -> tuple[str, str]:
    container.kill()  # SIGKILL, as the OOM killer or an operator would
    return "exited with code 137", " srv "
