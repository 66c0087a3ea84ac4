"""Carry out one planned step against the engine and Docker. The only place steps have effects."""

from __future__ import annotations

import time
from typing import Final

from . import logs
from .engines.base import Engine, StepContext
from .errors import Cancelled, Permanent
from .plan import AwaitReady, Prepare, Remove, Start, Step, Stop, exit_message
from .runtime import Container, Runtime

_PROBE_FIRST: Final = 0.05  # probes start fast (a warm engine answers at once) ...
_PROBE_EVERY: Final = 0.5  # ... and back off to this
_LOG_TAIL: Final = 5
log = logs.get("actions")


def describe(step: Step) -> str:
    """The status message while a step runs, before its own progress arrives."""
    match step:
        case Prepare(what):
            return f"preparing: {what}"
        case Start():
            return "starting the engine container"
        case AwaitReady():
            return "waiting for the engine to answer"
        case Stop(_, reason):
            return f"stopping the engine container ({reason})"
        case Remove():
            return "removing the old engine container"
    return type(step).__name__


def cancellable(step: Step) -> bool:
    """Stops and starts are short and must not be left half-done; the rest is interrupted."""
    return isinstance(step, Prepare | AwaitReady)


def execute(
    step: Step, engine: Engine, runtime: Runtime, generation: int, ctx: StepContext
) -> None:
    match step:
        case Prepare(what):
            engine.make(what, ctx)
        case Start(image_id):
            _start(engine, runtime, image_id, generation)
        case AwaitReady(container_id):
            _await_ready(engine, runtime, container_id, ctx)
        case Stop(container_id, reason):
            stop(runtime, container_id, engine.stop_grace, reason)
        case Remove(container_id):
            runtime.remove(container_id)
        case _:
            raise ValueError(f"{step!r} is not an action")


def _start(engine: Engine, runtime: Runtime, image_id: str, generation: int) -> None:
    endpoint = engine.endpoint()
    spec = engine.run_spec(image_id, generation, endpoint)
    container = runtime.run(spec)
    log.info(
        "engine container started",
        container=container.id[:12],
        image=image_id[:19],
        published=f"{endpoint.host}:{endpoint.port}",
    )


def last_lines(runtime: Runtime, container_id: str) -> str:
    return " | ".join(runtime.logs(container_id, tail=_LOG_TAIL))


def died(runtime: Runtime, container: Container) -> Permanent:
    tail = last_lines(runtime, container.id)
    return Permanent(exit_message(container) + (f": {tail}" if tail else ""))


def _await_ready(engine: Engine, runtime: Runtime, container_id: str, ctx: StepContext) -> None:
    endpoint = engine.endpoint()
    deadline = time.monotonic() + engine.ready_timeout
    last = ""
    pause = _PROBE_FIRST
    while not engine.ready(endpoint):
        container = runtime.container(engine.container_name)
        if container is None or container.id != container_id:
            raise Permanent("the engine container disappeared while it was starting")
        if not container.running:
            raise died(runtime, container)
        lines = runtime.logs(container_id, tail=1)
        if lines and lines[-1] != last:
            last = lines[-1]
            ctx.progress(last)
        if time.monotonic() > deadline:
            tail = last_lines(runtime, container_id)
            stop(runtime, container_id, engine.stop_grace, "never became ready")
            raise Permanent(f"not ready after {engine.ready_timeout:g}s; last output: {tail}")
        if ctx.sleep(pause):
            raise Cancelled("readiness wait cancelled")
        pause = min(pause * 2, _PROBE_EVERY)


def stop(runtime: Runtime, container_id: str, grace: float, reason: str) -> None:
    """Polite, then the grace, then kill (docker stop does all three); each step logged."""
    short = container_id[:12]
    started = time.monotonic()
    log.info("stopping engine container", container=short, grace=grace, reason=reason)
    runtime.stop(container_id, grace)
    after = time.monotonic() - started
    if after >= grace:
        log.warning(
            "engine container needed a kill after the grace",
            container=short,
            seconds=round(after, 1),
        )
    runtime.remove(container_id)
    log.info("engine container removed", container=short, seconds=round(after, 1))
