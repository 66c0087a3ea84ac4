"""Work off the worker's loop: a job (an observation or a step) in a thread of its own.

The loop begins one job at a time and reads what it left (its result, error and progress) once
it is finished; a job wakes the loop as its last act. The exit monitor wakes the loop the moment
the engine's container exits. Nothing here decides: the loop hands what a job left to plan().
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from supervisor.docker.runtime import Runtime
from supervisor.engines.base import Engine, Observed, StepContext
from supervisor.errors import Transient
from supervisor.worker import actions
from supervisor.worker.steps import Step
from supervisor.worker.wakeup import Wakeup

# jobs (observations, steps and what they spawn) yield the CPU to every worker's loop: under a
# burst of requests on a small machine, answers come before the work they start
JOB_NICE: Final = 10


@dataclass
class WorkerJob:
    """Work off the loop: an observation (step is None) or a step, in a thread of its own."""

    engine: Engine
    step: Step | None = None
    generation: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    progress: str = ""
    result: Observed | None = None
    error: BaseException | None = None
    started: float = field(default_factory=time.monotonic)
    stalled: bool = False  # reported as overdue
    finished: bool = False  # set by the job's thread as its last act, before it wakes the loop
    thread: threading.Thread | None = None
    answering: bool | None = None  # after an observation docker did not answer: the ready path

    def done(self) -> bool:
        # not thread.is_alive(): a thread that has woken the loop may still be alive for a
        # moment, and the loop would then sleep a whole poll before it noticed
        return self.finished

    @property
    def name(self) -> str:
        return "Observe" if self.step is None else type(self.step).__name__


def start(job: WorkerJob, runtime: Runtime, wake: Wakeup) -> None:
    """Run the job (observe, or its step) in a thread of its own; whatever it raises is kept on
    the job for the loop, and the job is finished (and the loop woken) however it ends."""

    def run() -> None:
        try:
            _yield_cpu()
            if job.step is None:
                observe(job)
            else:
                step(job, runtime, wake)
        except BaseException as exc:  # handed to the loop, which decides
            job.error = exc
        finally:
            job.finished = True
            wake.set()

    job.thread = threading.Thread(target=run, name=f"job-{job.name}", daemon=True)
    job.thread.start()


def observe(job: WorkerJob) -> None:
    """The body of an observation: what the engine sees, or, when docker does not answer,
    whether its ready path does."""
    try:
        job.result = job.engine.observe()
    except Transient:
        job.answering = _answers(job.engine)  # its ready path needs no docker
        raise


def step(job: WorkerJob, runtime: Runtime, wake: Wakeup) -> None:
    """The body of a step: carried out by actions; each progress line is kept on the job and
    wakes the loop, which relays it."""
    assert job.step is not None

    def progress(line: str) -> None:
        job.progress = line
        wake.set()

    ctx = StepContext(job.cancel, progress)
    actions.execute(job.step, job.engine, runtime, job.generation, ctx)


class ExitMonitor:
    """Calls exited the moment the engine's container exits (docker wait, no polling)."""

    def __init__(self, runtime: Runtime, exited: Callable[[], None]) -> None:
        self._runtime = runtime
        self._exited = exited
        self._monitored: str | None = None

    def watch(self, container_id: str) -> None:
        """Wait for this container's exit, once: watching it again changes nothing."""
        if self._monitored == container_id:
            return
        self._monitored = container_id

        def wait() -> None:
            self._runtime.wait(container_id)
            if self._monitored == container_id:
                self._monitored = None
            self._exited()

        threading.Thread(target=wait, name="exit-monitor", daemon=True).start()


def _yield_cpu() -> None:
    """Lower the calling thread's CPU priority by JOB_NICE (Linux: a thread id is a process id
    here); never raise it."""
    with contextlib.suppress(OSError, AttributeError):
        thread = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(current + JOB_NICE, 19))


def _answers(engine: Engine) -> bool:
    """One readiness probe, for an observation docker did not answer; a failure is a no."""
    try:
        return engine.ready()
    except Exception:  # a probe that cannot say yes says no
        return False
