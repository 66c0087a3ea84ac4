"""Carry out one planned step against the engine and Docker. The only place steps have effects;
each runs off the worker's loop, in a thread of its own."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Final

from supervisor import logs
from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Container, RunSpec
from supervisor.engines.base import EXIT_LOG_LINES, Engine, StepContext
from supervisor.errors import Cancelled, Permanent
from supervisor.worker import claims
from supervisor.worker.exits import exit_message
from supervisor.worker.steps import AwaitReady, Check, Prepare, Remove, Start, Step, Stop

_PROBE_FIRST: Final = 0.05  # probes start fast (a warm engine answers at once) ...
_PROBE_EVERY: Final = 0.5  # ... and back off to this
_LOG_TAIL: Final = 5
log = logs.get("actions")


def execute(
    step: Step, engine: Engine, runtime: Runtime, generation: int, ctx: StepContext
) -> None:
    match step:
        case Prepare(what):
            engine.make(what, ctx)
        case Check(spec, replacing):
            engine.preflight(spec, replacing, ctx)
            claims.check(engine, replacing)
        case Start(spec):
            try:
                made = _start(runtime, spec, generation)
            except BaseException:
                claims.started(engine, None)  # nothing runs: its memory claim is dropped
                raise
            claims.started(engine, made)
        case AwaitReady(container_id):
            _await_ready(engine, runtime, container_id, ctx)
        case Stop(container_id, reason):
            stop(runtime, container_id, engine.info.stop_grace, reason)
        case Remove(container_id):
            runtime.remove(container_id)


def stamped(spec: RunSpec, generation: int) -> RunSpec:
    """The spec as created: labelled with its request and its own fingerprint."""
    return replace(
        spec,
        labels={
            **spec.labels,
            labels.GENERATION: str(generation),
            labels.FINGERPRINT: spec.fingerprint(),
        },
    )


def _start(runtime: Runtime, spec: RunSpec, generation: int) -> str:
    container = runtime.run(stamped(spec, generation))
    log.info(
        "engine container started",
        container=container.id[:12],
        image=spec.image[:19],
        published=f"{spec.host_ip}:{spec.host_port}",
    )
    return container.id


def last_lines(runtime: Runtime, container_id: str) -> str:
    return " | ".join(runtime.logs(container_id, tail=_LOG_TAIL))


def died(runtime: Runtime, container: Container) -> Permanent:
    """A start that ended: its root cause, exit code and last lines, from the whole log."""
    return Permanent(exit_message(container, runtime.logs(container.id, tail=EXIT_LOG_LINES)))


def _await_ready(engine: Engine, runtime: Runtime, container_id: str, ctx: StepContext) -> None:
    deadline = time.monotonic() + engine.info.ready_timeout
    last = ""
    pause = _PROBE_FIRST
    while not engine.ready():
        container = runtime.container(engine.info.container_name)
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
            stop(runtime, container_id, engine.info.stop_grace, "never became ready")
            raise Permanent(f"not ready after {engine.info.ready_timeout:g}s; last output: {tail}")
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
