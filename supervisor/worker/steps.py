"""The steps a decision may name, and what status.json says while each runs.

Values only: a step names what to do (a spec, a container id); actions.py carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from supervisor.docker.spec import RunSpec
from supervisor.engines.base import Prerequisite


@dataclass(frozen=True)
class Prepare:
    what: Prerequisite


@dataclass(frozen=True)
class Check:
    """Before anything is stopped or started: can this spec start? (image, port, memory, the
    engine's own argument check). A failure leaves a running engine serving."""

    spec: RunSpec
    replacing: str | None = None  # the container a pass would replace


@dataclass(frozen=True)
class Start:
    spec: RunSpec


@dataclass(frozen=True)
class AwaitReady:
    container_id: str


@dataclass(frozen=True)
class Stop:
    container_id: str
    reason: str


@dataclass(frozen=True)
class Remove:
    container_id: str


Step = Prepare | Check | Start | AwaitReady | Stop | Remove


def describe(step: Step) -> str:
    """The status message while a step runs, before its own progress arrives."""
    match step:
        case Prepare(what):
            return f"preparing: {what.description}"
        case Check():
            return "checking that the engine can start"
        case Start():
            return "starting the engine container"
        case AwaitReady():
            return "waiting for the engine to answer"
        case Stop(_, reason):
            return f"stopping the engine container ({reason})"
        case Remove():
            return "removing the old engine container"


def cancellable(step: Step) -> bool:
    """Stops and starts are short and must not be left half-done; the rest is interrupted."""
    return isinstance(step, Prepare | Check | AwaitReady)
