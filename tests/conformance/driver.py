"""What the conformance suite needs to drive one engine kind, and the deaths drivers share.

Each EngineKind names its driver module (`conformance`): a module with `kind(make_engine,
request) -> Kind`. The suite runs every case once per registered kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
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
    start_timeout: float = 120  # seconds to running (the real vLLM CPU server loads slowly)
    edited_memory: str = "256m"  # a memory limit the engine starts with, other than its own
    edited_shm: str = "32m"  # a /dev/shm size the engine starts with, other than its own
    # knobs for a stop that takes a while, so that a kill before the grace would show
    slow_stop: dict[str, Any] = field(
        default_factory=lambda: {"settings": {"STOP_DELAY": "2", "TENSORFOLD_TEST_STOP_DELAY": "2"}}
    )
    # the slow step runs a command on the host (a prepare script), in a process group of its own
    step_processes: bool = False
    # knobs -> an engine running and its status, when the kind shares one
    # between cases (tests/conformance/relay.py); None: make(**knobs), then up
    take: Callable[[dict[str, Any]], tuple[Engine, dict[str, Any]]] | None = None
    hand: Callable[[Engine], None] | None = None  # the case leaves this engine to the next

    def running(self, **knobs: Any) -> tuple[Engine, dict[str, Any]]:
        """An engine made with these knobs that runs, and its running status."""
        if self.take is not None:
            return self.take(knobs)
        engine = self.make(**knobs)
        _, status = engine.up(timeout=self.start_timeout)
        return engine, status

    def hand_on(self, engine: Engine) -> None:
        """The case passed and leaves the engine running: a kind that shares may pass it on."""
        if self.hand is not None:
            self.hand(engine)


def dies_with_3_saying(logged: str) -> Callable[[Any], tuple[str, str]]:
    """The stand-in's /tmp/die: it exits with 3, logging a line with `logged` in it."""

    def die(container: Any) -> tuple[str, str]:
        container.exec_run(["sh", "-c", "echo 3 > /tmp/die"])
        return "exited with code 3", logged

    return die


def killed_saying(logged: str) -> Callable[[Any], tuple[str, str]]:
    """SIGKILL, as the OOM killer or an operator would: it exits with 137."""

    def die(container: Any) -> tuple[str, str]:
        container.kill()
        return "exited with code 137", logged

    return die


killed = killed_saying(" srv ")  # llama-server's last lines
