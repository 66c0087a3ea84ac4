"""Errors, split by what the worker does next."""

from __future__ import annotations


class SupervisorError(Exception):
    """Base of the worker's own errors; str() is one line for status.json."""


class Permanent(SupervisorError):
    """Retrying will not help: the generation is failed until the operator changes something
    (the recipe, the repository, the image) and requests again."""


class Blocked(Permanent):
    """Refused for now: something the step needs is held by another program or engine (a port,
    memory) or is not there (an image). Waiting may lift it, so the failure is shown and the step
    is tried again after a growing back-off; a Permanent that is not Blocked (arguments the
    engine's own check refused) is shown once and waits for a new request or a recipe reload."""


class MemoryBlocked(Blocked):
    """Blocked for memory: what other engines hold or use now leaves too little. status.json says
    so (`waitingFor: memory`), so the host may free memory it holds (the gateway's swap)."""


class Transient(SupervisorError):
    """The world was not ready (dockerd down, a network hiccup): retried after a back-off."""


class Cancelled(SupervisorError):
    """A newer request superseded the step; whatever it started has been undone."""


class BuildFailed(Permanent):
    def __init__(self, what: str, lines: list[str]) -> None:
        tail = " | ".join(lines[-5:]) if lines else "no output"
        super().__init__(f"{what} failed: {tail}")
        self.lines = lines
