"""The worker: lease, watch, reconcile, heartbeat, signals, sd_notify.

One loop thread only waits, records and writes: it reads desired.json, writes status.json and
the file_sd file, and pings the watchdog. Everything that may block (an observation of Docker,
git and the model library; a step) runs as a job in a thread of its own, one at a time, with a
deadline or a cancel. plan() decides; the loop applies its decisions and decides nothing itself.
Signal handlers only record, and wake the loop through the self-pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import FrameType
from typing import Any, Final

from watchfiles import watch

from supervisor import logs
from supervisor.docker.runtime import Runtime
from supervisor.engines import registry
from supervisor.engines.base import Engine, Observed, StepContext
from supervisor.errors import Blocked, Cancelled, Permanent, Transient
from supervisor.protocol import files
from supervisor.protocol.layout import DESIRED, STATUS, engine_dir
from supervisor.recipe.schema import Recipe
from supervisor.worker import actions, plan
from supervisor.worker.heartbeat import Heartbeat, last_written
from supervisor.worker.intake import intake, read_request
from supervisor.worker.notify import Notifier
from supervisor.worker.plan import Check, Decision, Memory, Reported, Step
from supervisor.worker.telemetry import FileSdWriter, Metrics
from supervisor.worker.wakeup import Wakeup

SAFETY_NET: Final = 5.0  # re-read desired.json even without a file event
OBSERVE_DEADLINE: Final = 10.0  # an observation that takes longer is reported, and waited for
_BACKOFF: Final = (1.0, 2.0, 5.0, 10.0)
_JOB_POLL: Final = 0.25
# watchfiles polls its event queue every `step` ms: 5 ms cost 1.2 % of a core while idle, 15 ms
# about 0.2 %, with the wake-up after a write at p50 24 ms, max 30 ms
WATCH_DEBOUNCE_MS: Final = 30
WATCH_STEP_MS: Final = 15
WATCH_RUST_TIMEOUT_MS: Final = 1000
# jobs (observations, steps and what they spawn) yield the CPU to every worker's loop: under a
# burst of requests on a small machine, answers come before the work they start
JOB_NICE: Final = 10
log = logs.get("worker")


@dataclass(frozen=True)
class Settings:
    name: str
    data_dir: Path
    state_dir: Path
    heartbeat: float = 15.0
    metrics_port: int | None = None


@dataclass
class Job:
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


class Worker:
    def __init__(
        self,
        settings: Settings,
        load_recipe: Callable[[], Recipe],
        runtime: Runtime | None = None,
    ) -> None:
        self.settings = settings
        self._load_recipe = load_recipe
        self.runtime = runtime or Runtime()
        self.directory = files.ensure_dir(engine_dir(settings.data_dir, settings.name))
        files.ensure_dir(settings.state_dir, mode=0o700)
        self.notifier = Notifier()
        self.metrics = Metrics(settings.name)
        self.heartbeat = Heartbeat(
            self.directory / STATUS,
            FileSdWriter(settings.data_dir, settings.name),
            settings.heartbeat,
            self.notifier,
            self.metrics,
        )
        self.engine: Engine = self._engine(load_recipe())
        self.memory: Memory | None = None
        self.decision: Decision | None = None
        self.refused: str | None = None
        self.job: Job | None = None
        self._wake = Wakeup()
        self._stop = threading.Event()
        self._signals: list[int] = []  # appended by the handlers, handled by the loop
        self._terms = 0
        self._retry_at = 0.0
        self._failures = 0
        self._observed_at = float("-inf")
        self._pending = True  # something happened that needs an observation now
        self._monitored: str | None = None
        self._reported: Reported | None = None  # what the last status.json said served

    def _engine(self, recipe: Recipe) -> Engine:
        return registry.create(
            self.settings.name, recipe, self.runtime, self.settings.state_dir,
            self.settings.data_dir,
        )  # fmt: skip

    # -- life ----------------------------------------------------------------------------------

    def run(self) -> int:
        with files.Lease(self.directory):
            log.info("worker started", name=self.settings.name, directory=str(self.directory))
            # read before this worker's first write replaces it: an engine that died while no
            # worker looked is still a death of the generation the last status said served
            self._reported = plan.reported(last_written(self.heartbeat.path), booted_at())
            for path in (
                self.heartbeat.path,
                self.heartbeat.file_sd.path,
                *self.engine.private_files(),
            ):
                for stale in files.remove_stale_temps(path):
                    log.info("removed a temp file left by an interrupted write", path=str(stale))
            self._install_signals()
            if self.settings.metrics_port:
                self.metrics.serve(self.settings.metrics_port)
            watcher = threading.Thread(target=self._watch, name="watch", daemon=True)
            watcher.start()
            try:
                self._loop()
            finally:
                self.notifier.stopping()
                self._stop.set()
                self._abandon_job()
                watcher.join(2)
                self._wake.close()
            log.info("worker stopped; the engine is left as it is", name=self.settings.name)
        return 0

    def _install_signals(self) -> None:
        def record(signum: int, frame: FrameType | None) -> None:
            self._signals.append(signum)  # list.append is atomic; the pipe wakes the loop

        self._wake.catch_signals()
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, record)

    def _watch(self) -> None:
        for _ in watch(
            self.directory,
            stop_event=self._stop,
            watch_filter=lambda _c, path: path.endswith(DESIRED),
            debounce=WATCH_DEBOUNCE_MS,
            step=WATCH_STEP_MS,
            rust_timeout=WATCH_RUST_TIMEOUT_MS,
        ):
            self._wake.set()

    def _handle_signals(self) -> None:
        while self._signals:
            signum = self._signals.pop(0)
            if signum == signal.SIGHUP:
                self._reload_recipe()
            else:
                self._terms += 1
                self._stop.set()

    def _abandon_job(self) -> None:
        """Cancel a running job and give it its time: a stop its grace, anything else 5 s. A
        second SIGTERM ends the wait at once (the step is left to dockerd)."""
        job = self.job
        if job is None or job.thread is None:
            return
        job.cancel.set()
        long = job.step is not None and not plan.cancellable(job.step)
        limit = time.monotonic() + (self.engine.stop_grace + 10 if long else 5)
        terms = self._terms
        while not job.finished and time.monotonic() < limit:
            self._wake.wait(0.1)
            self._handle_signals()
            if self._terms > terms:
                log.warning("second stop signal: not waiting for the step", step=job.name)
                return

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        ready_sent = False
        while True:
            self._handle_signals()
            if self._stop.is_set():
                return
            self.notifier.watchdog()
            self._read_request()
            job = self.job
            if job is not None and job.done():
                self._finish(job)
            elif job is not None:
                self._watch_job(job)
            if self.job is None and self._observe_due():
                self._begin(Job(self.engine), self._observe_body)
            self.heartbeat.tick()
            if not ready_sent and self.heartbeat.status is not None:
                self.notifier.ready()
                ready_sent = True
            self._wake.wait(self._next_wait())

    def _observe_due(self) -> bool:
        """Observe when something happened, or every poll interval as a safety net: an idle
        worker costs no docker calls in between."""
        now = time.monotonic()
        if now < self._retry_at:
            return False
        if self._failure_retry_in(now) == 0.0:
            return True
        return self._pending or now - self._observed_at >= self.engine.poll_interval

    def _failure_retry_in(self, now: float) -> float | None:
        """How long until a failed step may be tried again (0: now); None: not by waiting."""
        memory = self.memory
        if memory is None or memory.failure is None or memory.retry_at is None:
            return None
        return max(memory.retry_at - now, 0.0)

    def _next_wait(self) -> float:
        now = time.monotonic()
        waits = [self.heartbeat.due_in(), SAFETY_NET]
        if self.job is not None:
            waits.append(_JOB_POLL)
        elif self._retry_at > now:
            waits.append(self._retry_at - now)
        else:
            waits.append(max(self.engine.poll_interval - (now - self._observed_at), 0.0))
            failure_retry = self._failure_retry_in(now)
            if failure_retry is not None:
                waits.append(failure_retry)
        if self.notifier.watchdog_interval is not None:
            waits.append(self.notifier.watchdog_interval / 2)
        return max(min(waits), 0.01)

    def _reload_recipe(self) -> None:
        try:
            recipe = self._load_recipe()
        except (ValueError, OSError) as exc:
            log.error("recipe reload refused; keeping the previous recipe", error=str(exc))
            return
        if self.job is not None:
            self.job.cancel.set()
        self.engine = self._engine(recipe)
        if self.memory is not None:  # re-apply the current request to the new recipe
            self.memory = plan.reloaded(self.memory)
        self._retry_at = 0.0
        self._pending = True
        log.info("recipe reloaded", name=self.settings.name)

    # -- desired.json --------------------------------------------------------------------------

    def _read_request(self) -> None:
        taken = intake(self.memory, self.decision, read_request(self.directory / DESIRED),
                       self._reported)  # fmt: skip
        refused = taken.refused
        if refused != self.refused:
            self.refused = refused
            if refused:
                log.warning("desired.json refused; the engine is left as it is", reason=refused)
            if self.decision is not None and taken.acknowledged is None:
                self._show(self.decision)  # say so at once; nothing else changes
        decision = taken.acknowledged
        if decision is None:
            return
        memory = taken.memory
        assert memory is not None
        if self.memory is not None and self.memory.generation == memory.generation:
            log.warning(
                "desired changed without a new generation; applying it",
                generation=memory.generation,
            )
        log.info("request acknowledged", generation=memory.generation, desired=memory.desired)
        self._retry_at = 0.0
        self._failures = 0
        self._pending = True
        if self.job is not None and self.job.step is not None and plan.cancellable(self.job.step):
            self.job.cancel.set()
        self._apply(decision)

    # -- jobs: observe, then plan, then a step -------------------------------------------------

    def _begin(self, job: Job, body: Callable[[Job], Any]) -> None:
        def run() -> None:
            try:
                _yield_cpu()
                body(job)
            except BaseException as exc:  # handed to the loop, which decides
                job.error = exc
            finally:
                job.finished = True
                self._wake.set()

        if job.step is None:
            self._pending = False
        job.thread = threading.Thread(target=run, name=f"job-{job.name}", daemon=True)
        self.job = job
        job.thread.start()

    def _observe_body(self, job: Job) -> None:
        try:
            job.result = job.engine.observe()
        except Transient:
            job.answering = _answers(job.engine)  # its ready path needs no docker
            raise

    def _step_body(self, job: Job) -> None:
        assert job.step is not None
        ctx = StepContext(job.cancel, lambda line: self._progress(job, line))
        actions.execute(job.step, job.engine, self.runtime, job.generation, ctx)

    def _progress(self, job: Job, line: str) -> None:
        job.progress = line
        self._wake.set()

    def _watch_job(self, job: Job) -> None:
        """While a job runs: relay a step's progress; say when an observation is overdue."""
        if job.step is not None:
            if job.progress:
                self.heartbeat.progress(job.progress)
            return
        if not job.stalled and time.monotonic() - job.started > OBSERVE_DEADLINE:
            job.stalled = True
            reason = f"docker did not answer within {OBSERVE_DEADLINE:g} s; still waiting"
            log.warning("observation overdue", seconds=OBSERVE_DEADLINE)
            self.metrics.failures.labels(reason="stalled").inc()
            if self.decision is not None:
                self._apply(plan.stalled(self.decision, reason), quiet=True)

    def _finish(self, job: Job) -> None:
        self.job = None
        self.metrics.step_seconds.labels(step=job.name).observe(time.monotonic() - job.started)
        if job.engine is not self.engine:  # begun under a recipe since reloaded
            self._pending = True
            return
        if job.step is None:
            self._observed(job)
        else:
            self._stepped(job, job.step)

    def _observed(self, job: Job) -> None:
        self._observed_at = time.monotonic()
        self.metrics.reconciles.inc()
        error = job.error
        if isinstance(error, Transient):
            self._retry(error, job.answering)
        elif error is not None:
            self._fail_outside_a_step("observation", error)
        elif job.result is not None:
            self._failures = 0
            self.metrics.set_load_failed(job.engine.failed_models())
            decision = plan.plan(self.memory, job.result, time.monotonic())
            if not plan.means_to_start(decision.memory):  # before a step that may claim anew
                container = job.result.container
                self.engine.abandoned(container.id if container and container.running else None)
            self._apply(decision)

    def _stepped(self, job: Job, step: Step) -> None:
        self._pending = True
        memory, error = self.memory, job.error
        if memory is None or memory.generation != job.generation or isinstance(error, Cancelled):
            return  # superseded: the loop plans afresh for the newer request
        if isinstance(error, Transient):
            self._retry(error)
            return
        reason = None
        if isinstance(error, Permanent):
            reason = str(error)
        elif error is not None:
            log.error("step crashed", step=job.name, error=repr(error), exc_info=error)
            reason = f"internal error: {error!r}"
        self.memory = plan.conclude(
            memory, step, reason, time.monotonic(), waitable=isinstance(error, Blocked)
        )
        if reason is not None:
            retry_in = self._failure_retry_in(time.monotonic())
            log.error(
                "step failed",
                step=job.name,
                generation=job.generation,
                reason=reason,
                retry_in=None if retry_in is None else round(retry_in, 1),
            )
            self.metrics.failures.labels(reason=job.name).inc()
        planned = self.engine.planned_memory() if isinstance(step, Check) else None
        if planned is not None:
            self.metrics.memory_need.set(planned[0])
            self.metrics.memory_limit.set(planned[1])

    def _fail_outside_a_step(self, where: str, error: BaseException) -> None:
        if not isinstance(error, Permanent):
            log.error(f"{where} crashed", error=repr(error), exc_info=error)
        reason = str(error) if isinstance(error, Permanent) else f"internal error: {error!r}"
        if self.memory is None:
            self._apply(plan.unobserved(None, reason))
        else:
            self._apply(plan.failed(self.memory, reason, time.monotonic()))

    def _retry(self, error: BaseException, answering: bool | None = None) -> None:
        delay = _BACKOFF[min(self._failures, len(_BACKOFF) - 1)]
        self._failures += 1
        self._retry_at = time.monotonic() + delay
        self._pending = True
        self.metrics.failures.labels(reason="transient").inc()
        log.warning("will retry", error=str(error), seconds=delay)
        reason = f"{error}; retrying in {delay:g}s"
        self._apply(plan.unobserved(self.memory, reason, self.decision, answering))

    # -- applying a decision -------------------------------------------------------------------

    def _apply(self, decision: Decision, quiet: bool = False) -> None:
        """Write what the decision says, and begin its step: the one place decisions land."""
        before = self.memory
        self.memory = decision.memory
        self.decision = decision
        memory = decision.memory
        if memory is not None and memory.failure and (before is None or not before.failure):
            log.error("request failed", generation=memory.generation, reason=memory.failure)
            self.metrics.failures.labels(reason="engine").inc()
        self._show(decision)
        if decision.answer.state == "running" and memory is not None and memory.ready:
            self._monitor(memory.ready)
        step = decision.step
        if step is not None and memory is not None:
            if not quiet:
                log.info("step", step=plan.describe(step), generation=memory.generation)
            self._begin(Job(self.engine, step, memory.generation), self._step_body)

    def _show(self, decision: Decision) -> None:
        answer = decision.answer
        job = self.job
        if job is not None and job.step is not None and job.progress:
            answer = replace(answer, message=job.progress)
        self.heartbeat.show(plan.shown(answer, self.refused), self.refused, decision.targets)

    def _monitor(self, container_id: str) -> None:
        """Wake the loop the moment the engine's container exits (docker wait, no polling)."""
        if self._monitored == container_id:
            return
        self._monitored = container_id

        def wait() -> None:
            self.runtime.wait(container_id)
            if self._monitored == container_id:
                self._monitored = None
            self._pending = True
            self._wake.set()

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


def booted_at() -> datetime:
    """When this machine booted (a status.json from before was written by another boot)."""
    uptime = time.clock_gettime(time.CLOCK_BOOTTIME)
    return datetime.now(UTC) - timedelta(seconds=uptime)
