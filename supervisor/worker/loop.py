"""The worker: lease, watch, reconcile, heartbeat, signals, sd_notify.

One loop thread only waits, records and writes: it reads desired.json, writes status.json and
the file_sd file, and pings the watchdog. Everything that may block (an observation of Docker,
git and the model library; a step) runs as a job (jobs.py) in a thread of its own, one at a
time, with a deadline or a cancel. plan() decides; the loop applies its decisions and decides
nothing itself. Signal handlers only record, and wake the loop through the self-pipe.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final

from supervisor import logs
from supervisor.docker.runtime import Runtime
from supervisor.engines import registry
from supervisor.engines.base import Engine
from supervisor.errors import Blocked, Cancelled, MemoryBlocked, Permanent, Transient
from supervisor.notify import Notifier
from supervisor.protocol import files
from supervisor.protocol.layout import DESIRED, STATUS, engine_dir
from supervisor.recipe.schema import Recipe
from supervisor.worker import claims, jobs, plan, pursuit
from supervisor.worker.heartbeat import Heartbeat, booted_at, last_written
from supervisor.worker.intake import intake, read_request
from supervisor.worker.jobs import ExitMonitor, WorkerJob
from supervisor.worker.plan import Decision
from supervisor.worker.steps import Check, Step, cancellable, describe
from supervisor.worker.telemetry import FileSdWriter, WorkerMetrics
from supervisor.worker.wakeup import Signals, Wakeup
from supervisor.worker.watch import DesiredWatch

SAFETY_NET: Final = 5.0  # re-read desired.json even without a file event
OBSERVE_DEADLINE: Final = 10.0  # an observation that takes longer is reported, and waited for
_BACKOFF: Final = (1.0, 2.0, 5.0, 10.0)
_JOB_POLL: Final = 0.25
log = logs.get("worker")


@dataclass(frozen=True)
class WorkerSettings:
    name: str
    data_dir: Path
    state_dir: Path
    heartbeat: float = 15.0
    metrics_port: int | None = None


class Worker:
    def __init__(
        self,
        settings: WorkerSettings,
        load_recipe: Callable[[], Recipe],
        runtime: Runtime | None = None,
    ) -> None:
        self.settings = settings
        self._load_recipe = load_recipe
        self.runtime = runtime or Runtime()
        self.directory = files.ensure_dir(engine_dir(settings.data_dir, settings.name))
        files.ensure_dir(settings.state_dir, mode=0o700)
        self.notifier = Notifier()
        self.metrics = WorkerMetrics(settings.name)
        file_sd = FileSdWriter(settings.data_dir, settings.name)
        self.heartbeat = Heartbeat(
            self.directory / STATUS, file_sd, settings.heartbeat, self.notifier, self.metrics
        )
        self.engine: Engine = self._engine(load_recipe())
        self.heartbeat.models = self.engine.info.models
        self.pursuit: pursuit.Pursuit | None = None
        self.decision: Decision | None = None
        self.refused: str | None = None  # why desired.json is refused
        self.recipe_refused: str | None = None  # why the last recipe reload was refused
        self.job: WorkerJob | None = None
        self._wake = Wakeup()
        self._stop = threading.Event()
        self._signals = Signals()  # recorded by the handlers, handled by the loop
        self._terms = 0
        self._retry_at = 0.0
        self._failures = 0
        self._observed_at = float("-inf")
        self._pending = True  # something happened that needs an observation now
        self.exit_monitor = ExitMonitor(self.runtime, self._exited)
        self._reported: pursuit.Reported | None = None  # what the last status.json said served

    def _engine(self, recipe: Recipe) -> Engine:
        return registry.create(
            self.settings.name,
            recipe,
            self.runtime,
            self.settings.state_dir,
            self.settings.data_dir,
        )

    # -- life ----------------------------------------------------------------------------------

    def run(self) -> int:
        with files.Lease(self.directory):
            log.info("worker started", name=self.settings.name, directory=str(self.directory))
            # read before this worker's first write replaces it: an engine that died while no
            # worker looked is still a death of the generation the last status said served
            self._reported = pursuit.reported(last_written(self.heartbeat.path), booted_at())
            for path in (
                self.heartbeat.path,
                self.heartbeat.file_sd.path,
                *self.engine.info.private_files,
            ):
                for stale in files.remove_stale_temps(path):
                    log.info("removed a temp file left by an interrupted write", path=str(stale))
            self._signals.install(self._wake)
            if self.settings.metrics_port:
                self.metrics.serve(self.settings.metrics_port)
            try:
                self._wake.attach(DesiredWatch(self.directory))
            except OSError as exc:  # the user's inotify instances or watches are all taken
                log.error(
                    "cannot watch desired.json; it is read again every few seconds instead",
                    error=str(exc),
                    every_s=SAFETY_NET,
                )
            try:
                self._loop()
            finally:
                self.notifier.stopping()
                self._stop.set()
                self._abandon_job()
                self._wake.close()
            log.info("worker stopped; the engine is left as it is", name=self.settings.name)
        return 0

    def _handle_signals(self) -> None:
        for signum in self._signals.taken():
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
        long = job.step is not None and not cancellable(job.step)
        limit = time.monotonic() + (self.engine.info.stop_grace + 10 if long else 5)
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
                self._begin(WorkerJob(self.engine))
            self.heartbeat.tick()
            if not ready_sent and self.heartbeat.status is not None:
                self.notifier.ready()
                ready_sent = True
            self._wake.wait(self._next_wait())
            if self._wake.full_look_due():
                self._pending = True  # the watch missed events: read and observe anew

    def _observe_due(self) -> bool:
        """Observe when something happened, or every poll interval as a safety net: an idle
        worker costs no docker calls in between."""
        now = time.monotonic()
        if now < self._retry_at:
            return False
        if pursuit.retry_in(self.pursuit, now) == 0.0:
            return True
        return self._pending or now - self._observed_at >= self.engine.info.poll_interval

    def _next_wait(self) -> float:
        now = time.monotonic()
        waits = [self.heartbeat.due_in(), SAFETY_NET]
        if self.job is not None:
            waits.append(_JOB_POLL)
        elif self._retry_at > now:
            waits.append(self._retry_at - now)
        else:
            waits.append(max(self.engine.info.poll_interval - (now - self._observed_at), 0.0))
            failure_retry = pursuit.retry_in(self.pursuit, now)
            if failure_retry is not None:
                waits.append(failure_retry)
        if self.notifier.watchdog_interval is not None:
            waits.append(self.notifier.watchdog_interval / 2)
        return max(min(waits), 0.01)

    def _reload_recipe(self) -> None:
        """A valid recipe replaces the engine's; a refused one leaves it and is said in status."""
        try:
            recipe = self._load_recipe()
        except (ValueError, OSError) as exc:
            log.error("recipe reload refused; keeping the previous recipe", error=str(exc))
            self.recipe_refused = str(exc)
        else:
            if self.job is not None:
                self.job.cancel.set()
            self.engine = self._engine(recipe)
            self.heartbeat.models = self.engine.info.models
            self.heartbeat.capabilities = {}  # the new recipe's, at the next look
            if self.pursuit is not None:  # re-apply the current request to the new recipe
                self.pursuit = pursuit.reloaded(self.pursuit)
            self._retry_at = 0.0
            self._pending = True
            self.recipe_refused = None
            log.info("recipe reloaded", name=self.settings.name)
        if self.decision is not None:
            self._show(self.decision)

    # -- desired.json --------------------------------------------------------------------------

    def _read_request(self) -> None:
        taken = intake(
            self.pursuit, self.decision, read_request(self.directory / DESIRED), self._reported
        )
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
        accepted = taken.pursuit
        assert accepted is not None
        if self.pursuit is not None and self.pursuit.generation == accepted.generation:
            log.warning(
                "desired changed without a new generation; applying it",
                generation=accepted.generation,
            )
        log.info("request acknowledged", generation=accepted.generation, desired=accepted.desired)
        self._retry_at = 0.0
        self._failures = 0
        self._pending = True
        if self.job is not None and self.job.step is not None and cancellable(self.job.step):
            self.job.cancel.set()
        self._apply(decision)

    # -- jobs: observe, then plan, then a step -------------------------------------------------

    def _begin(self, job: WorkerJob) -> None:
        if job.step is None:
            self._pending = False
        self.job = job
        jobs.start(job, self.runtime, self._wake)

    def _watch_job(self, job: WorkerJob) -> None:
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

    def _finish(self, job: WorkerJob) -> None:
        self.job = None
        self.metrics.step_seconds.labels(step=job.name).observe(time.monotonic() - job.started)
        if job.engine is not self.engine:  # begun under a recipe since reloaded
            self._pending = True
            return
        if job.step is None:
            self._observed(job)
        else:
            self._stepped(job, job.step)

    def _observed(self, job: WorkerJob) -> None:
        self._observed_at = time.monotonic()
        self.metrics.reconciles.inc()
        error = job.error
        if isinstance(error, Transient):
            self._retry(error, job.answering)
        elif error is not None:
            self._fail_outside_a_step("observation", error)
        elif job.result is not None:
            self._failures = 0
            self.metrics.set_load_failed(job.result.failed)
            self.heartbeat.observed(job.result)
            decision = plan.plan(self.pursuit, job.result, time.monotonic())
            if not pursuit.means_to_start(decision.pursuit):  # before a step that may claim anew
                seen = job.result.container
                claims.abandoned(self.engine, seen.id if seen and seen.running else None)
            self._apply(decision)

    def _stepped(self, job: WorkerJob, step: Step) -> None:
        self._pending = True
        current, error = self.pursuit, job.error
        if current is None or current.generation != job.generation or isinstance(error, Cancelled):
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
        waitable, blocked = isinstance(error, Blocked), isinstance(error, MemoryBlocked)
        self.pursuit = pursuit.conclude(
            current, step, reason, time.monotonic(), waitable=waitable, memory_blocked=blocked
        )
        if reason is not None:
            wait = pursuit.retry_in(self.pursuit, time.monotonic())
            log.error(
                "step failed",
                step=job.name,
                generation=job.generation,
                reason=reason,
                retry_in=None if wait is None else round(wait, 1),
            )
            self.metrics.failures.labels(reason=job.name).inc()
        planned = claims.planned(self.engine) if isinstance(step, Check) else None
        if planned is not None:
            self.metrics.memory_need.set(planned[0])
            self.metrics.memory_limit.set(planned[1])

    def _fail_outside_a_step(self, where: str, error: BaseException) -> None:
        if not isinstance(error, Permanent):
            log.error(f"{where} crashed", error=repr(error), exc_info=error)
        reason = str(error) if isinstance(error, Permanent) else f"internal error: {error!r}"
        if self.pursuit is None:
            self._apply(plan.unobserved(None, reason))
        else:
            self._apply(plan.failed(self.pursuit, reason, time.monotonic()))

    def _retry(self, error: BaseException, answering: bool | None = None) -> None:
        delay = _BACKOFF[min(self._failures, len(_BACKOFF) - 1)]
        self._failures += 1
        self._retry_at = time.monotonic() + delay
        self._pending = True
        self.metrics.failures.labels(reason="transient").inc()
        log.warning("will retry", error=str(error), seconds=delay)
        reason = f"{error}; retrying in {delay:g}s"
        self._apply(plan.unobserved(self.pursuit, reason, self.decision, answering))

    # -- applying a decision -------------------------------------------------------------------

    def _apply(self, decision: Decision, quiet: bool = False) -> None:
        """Write what the decision says, and begin its step: the one place decisions land."""
        before = self.pursuit
        self.pursuit = decision.pursuit
        self.decision = decision
        current = decision.pursuit
        if current is not None and current.failure and (before is None or not before.failure):
            log.error("request failed", generation=current.generation, reason=current.failure)
            self.metrics.failures.labels(reason="engine").inc()
        self._show(decision)
        if decision.answer.state == "running" and current is not None and current.ready:
            self.exit_monitor.watch(current.ready)
        step = decision.step
        if step is not None and current is not None:
            if not quiet:
                log.info("step", step=describe(step), generation=current.generation)
            self._begin(WorkerJob(self.engine, step, current.generation))

    def _show(self, decision: Decision) -> None:
        answer = decision.answer
        job = self.job
        if job is not None and job.step is not None and job.progress:
            answer = replace(answer, message=job.progress)
        shown = plan.shown(answer, self.refused, self.recipe_refused)
        self.heartbeat.show(shown, self.refused, decision.targets)

    def _exited(self) -> None:
        """The engine's container exited: observe at once."""
        self._pending = True
        self._wake.set()
