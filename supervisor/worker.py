"""The worker: lease, watch, reconcile, heartbeat, signals, sd_notify.

One thread decides. Signal handlers only record; a watcher thread and an exit monitor only wake
the loop; a long step runs in a thread of its own so that the loop keeps the heartbeat and can
cancel the step when a newer request arrives.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Final

from watchfiles import watch

from . import actions, engines, files, logs
from .engines.base import Engine, StepContext
from .errors import Cancelled, Permanent, Transient
from .heartbeat import Heartbeat
from .host import DESIRED, STATUS, engine_dir
from .notify import Notifier
from .plan import (
    AwaitReady,
    Fail,
    Memory,
    Observed,
    Prepare,
    Remove,
    Settle,
    Start,
    Step,
    Stop,
    plan,
)
from .protocol import DesiredFile, InvalidDocument, State, parse_desired
from .recipe import Recipe
from .runtime import Runtime
from .telemetry import FileSdWriter, Metrics

SAFETY_NET: Final = 5.0  # re-read desired.json even without a file event
_BACKOFF: Final = (1.0, 2.0, 5.0, 10.0)
log = logs.get("worker")


@dataclass(frozen=True)
class Settings:
    name: str
    data_dir: Path
    state_dir: Path
    heartbeat: float = 15.0
    metrics_port: int | None = None


@dataclass
class Task:
    """A step running in its own thread."""

    step: Step
    generation: int
    cancel: threading.Event = field(default_factory=threading.Event)
    progress: str = ""
    error: BaseException | None = None
    serving: bool = False  # the engine keeps serving while this step runs
    started: float = field(default_factory=time.monotonic)
    thread: threading.Thread | None = None

    def done(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()


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
            self.directory / STATUS, settings.heartbeat, self.notifier, self.metrics
        )
        self.file_sd = FileSdWriter(settings.data_dir, settings.name)
        self.engine: Engine = self._engine(load_recipe())
        self.memory: Memory | None = None
        self.refused: str | None = None
        self.task: Task | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._reload = False
        self._retry_at = 0.0
        self._failures = 0
        self._observed_at = float("-inf")
        self._pending = True  # something happened that needs a reconcile now
        self._monitored: str | None = None

    def _engine(self, recipe: Recipe) -> Engine:
        return engines.create(self.settings.name, recipe, self.runtime, self.settings.state_dir)

    # -- life ----------------------------------------------------------------------------------

    def run(self) -> int:
        with files.Lease(self.directory):
            log.info("worker started", name=self.settings.name, directory=str(self.directory))
            for path in (self.heartbeat.path, self.file_sd.path, *self.engine.private_files()):
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
                self._abandon_task()
                watcher.join(2)
            log.info("worker stopped; the engine is left as it is", name=self.settings.name)
        return 0

    def _install_signals(self) -> None:
        def on_term(signum: int, frame: FrameType | None) -> None:
            self._stop.set()
            self._wake.set()

        def on_hup(signum: int, frame: FrameType | None) -> None:
            self._reload = True
            self._wake.set()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        signal.signal(signal.SIGHUP, on_hup)

    def _watch(self) -> None:
        for _ in watch(
            self.directory,
            stop_event=self._stop,
            # watchfiles polls its event queue every `step` ms: 5 ms cost 1.2 % of a core while
            # idle, 15 ms about 0.2 %, with the wake-up after a write at p50 24 ms, max 30 ms
            debounce=30,
            step=15,
            rust_timeout=1000,
            watch_filter=lambda _c, path: path.endswith(DESIRED),
        ):
            self._wake.set()

    def _abandon_task(self) -> None:
        task = self.task
        if task is None or task.thread is None:
            return
        task.cancel.set()
        task.thread.join(self.engine.stop_grace + 10 if not actions.cancellable(task.step) else 5)

    # -- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        ready_sent = False
        while not self._stop.is_set():
            self.notifier.watchdog()
            if self._reload:
                self._reload = False
                self._reload_recipe()
            self._read_request()
            if self.task is not None and self.task.done():
                self._finish(self.task)
            if self.task is None and self._reconcile_due():
                self._reconcile_guarded()
            elif self.task is not None and self.task.progress:
                self._report_task(self.task)
            self.heartbeat.tick()
            if not ready_sent and self.heartbeat.status is not None:
                self.notifier.ready()
                ready_sent = True
            self._wake.wait(self._next_wait())
            self._wake.clear()

    def _reconcile_due(self) -> bool:
        """Observe when something happened, or every poll interval as a safety net: an idle
        worker costs no docker calls in between."""
        now = time.monotonic()
        if now < self._retry_at:
            return False
        return self._pending or now - self._observed_at >= self.engine.poll_interval

    def _next_wait(self) -> float:
        waits = [self.heartbeat.due_in(), SAFETY_NET]
        if self.task is not None:
            waits.append(0.25)
        elif self._retry_at > time.monotonic():
            waits.append(self._retry_at - time.monotonic())
        else:
            since = time.monotonic() - self._observed_at
            waits.append(max(self.engine.poll_interval - since, 0.0))
        if self.notifier.watchdog_interval is not None:
            waits.append(self.notifier.watchdog_interval / 2)
        return max(min(waits), 0.01)

    def _reload_recipe(self) -> None:
        try:
            recipe = self._load_recipe()
        except (ValueError, OSError) as exc:
            log.error("recipe reload refused; keeping the previous recipe", error=str(exc))
            return
        if self.task is not None:
            self.task.cancel.set()
        self.engine = self._engine(recipe)
        if self.memory is not None:  # re-apply the current request to the new recipe
            self.memory = Memory(self.memory.generation, self.memory.desired)
        self._retry_at = 0.0
        self._pending = True
        log.info("recipe reloaded", name=self.settings.name)

    def _read_request(self) -> None:
        path = self.directory / DESIRED
        try:
            desired: DesiredFile | None = parse_desired(files.read_text(path))
            refused = None
        except FileNotFoundError:
            desired, refused = None, None
        except (files.FileRefused, InvalidDocument) as exc:
            desired = None
            refused = str(exc) if isinstance(exc, files.FileRefused) else f"{path}: {exc}"
        if refused != self.refused:
            self.refused = refused
            self._pending = True
            if refused:
                log.warning("desired.json refused; the engine is left as it is", reason=refused)
            self._show_refusal()
        if desired is None:
            return
        memory = self.memory
        if memory is not None and memory.generation == desired.generation:
            if memory.desired == desired.desired:
                return
            log.warning(
                "desired changed without a new generation; applying it",
                generation=desired.generation,
            )
        self._accept(desired)

    def _accept(self, desired: DesiredFile) -> None:
        previous = self.memory
        # asking again for what already serves needs no new readiness probe (a failure is
        # never carried over: a new request retries)
        ready = (
            previous.ready
            if previous is not None
            and previous.desired == desired.desired
            and previous.failure is None
            else None
        )
        self.memory = Memory(desired.generation, desired.desired, ready=ready)
        self._retry_at = 0.0
        self._pending = True
        self._failures = 0
        if self.task is not None and actions.cancellable(self.task.step):
            self.task.cancel.set()
        state: State = "starting" if desired.desired == "running" else "stopping"
        log.info("request acknowledged", generation=desired.generation, desired=desired.desired)
        self._report(state, f"acknowledged: {desired.desired} requested")

    # -- reconcile: observe, plan, act ---------------------------------------------------------

    def _reconcile_guarded(self) -> None:
        """A docker call anywhere in a reconcile (observing, settling) may find dockerd gone."""
        try:
            self._reconcile()
        except Transient as exc:
            self._retry(exc)
        except Permanent as exc:
            if self.memory is not None:
                self.memory = replace(self.memory, failure=str(exc))
                self._pending = True

    def _reconcile(self) -> None:
        self._pending = False
        memory = self.memory
        try:
            observed = self.engine.observe()
        except Transient as exc:
            self._retry(exc)
            return
        except Permanent as exc:
            if memory is not None:
                self.memory = replace(memory, failure=str(exc))
            observed = None
        self._observed_at = time.monotonic()
        self.metrics.reconciles.inc()
        if memory is None:
            self._report_unrequested(observed)
            return
        if observed is None:
            self._publish()
            return
        self._apply(plan(self.memory or memory, observed), observed)

    def _apply(self, step: Step, observed: Observed) -> None:
        memory = self.memory
        assert memory is not None
        if isinstance(step, Fail):
            reason = step.message
            if step.logs_of is not None:
                reason = _with_tail(reason, self.runtime, step.logs_of)
            log.error("request failed", generation=memory.generation, reason=reason)
            self.metrics.failures.labels(reason="engine").inc()
            self.memory = replace(memory, failure=reason)
            self._pending = True
            self._wake.set()
            return
        if isinstance(step, Settle):
            self._settle(step.state)
            return
        self._failures = 0
        container = observed.container
        serving = (
            isinstance(step, Prepare)
            and container is not None
            and container.running
            and container.id == memory.ready
        )
        self._begin(step, memory, serving)

    def _begin(self, step: Step, memory: Memory, serving: bool) -> None:
        task = Task(step, memory.generation, serving=serving)
        ctx = StepContext(task.cancel, lambda line: self._progress(task, line))

        def body() -> None:
            try:
                actions.execute(step, self.engine, self.runtime, memory.generation, ctx)
            except BaseException as exc:  # handed to the loop, which decides
                task.error = exc
            finally:
                self._wake.set()

        if isinstance(step, Start | Stop | Remove):
            # no engine answers from here on (a re-acknowledged request for a running engine
            # keeps its target: the engine goes on serving)
            self.file_sd.publish(None)
        task.thread = threading.Thread(target=body, name=f"step-{type(step).__name__}", daemon=True)
        self.task = task
        log.info("step", step=actions.describe(step), generation=memory.generation)
        self._report_task(task)
        task.thread.start()

    def _progress(self, task: Task, line: str) -> None:
        task.progress = line
        self._wake.set()

    def _finish(self, task: Task) -> None:
        self.task = None
        self._pending = True
        name = type(task.step).__name__
        self.metrics.step_seconds.labels(step=name).observe(time.monotonic() - task.started)
        memory = self.memory
        error = task.error
        if memory is None or memory.generation != task.generation or isinstance(error, Cancelled):
            return  # superseded: the loop plans afresh for the newer request
        if error is None:
            if isinstance(task.step, AwaitReady):
                self.memory = replace(memory, ready=task.step.container_id)
            return
        if isinstance(error, Transient):
            self._retry(error)
            return
        if not isinstance(error, Permanent):
            log.error("step crashed", step=name, error=repr(error), exc_info=error)
        reason = str(error) if isinstance(error, Permanent) else f"internal error: {error!r}"
        log.error("step failed", step=name, generation=memory.generation, reason=reason)
        self.metrics.failures.labels(reason=name).inc()
        self.memory = replace(memory, failure=reason)

    def _retry(self, error: BaseException) -> None:
        delay = _BACKOFF[min(self._failures, len(_BACKOFF) - 1)]
        self._failures += 1
        self._retry_at = time.monotonic() + delay
        self._pending = True
        self.metrics.failures.labels(reason="transient").inc()
        log.warning("will retry", error=str(error), seconds=delay)
        message = f"{error}; retrying in {delay:g}s"
        if self.memory is not None:
            self._report(self._working_state(), message)
        else:  # nothing requested yet, and the engine cannot be seen: say exactly that
            self.heartbeat.set(
                0, "failed", f"cannot observe the engine: {message}", None, self.refused
            )

    # -- reporting -----------------------------------------------------------------------------

    def _report_task(self, task: Task) -> None:
        """While a step runs: starting or stopping, or running while a serving engine keeps
        serving (a library re-sync, a preset rewrite)."""
        message = task.progress or actions.describe(task.step)
        if task.serving:
            self._report("running", message, self.engine.endpoint().url)
        else:
            self._report(self._working_state(), message)

    def _working_state(self) -> State:
        memory = self.memory
        return "starting" if memory is None or memory.desired == "running" else "stopping"

    def _settle(self, state: State) -> None:
        memory = self.memory
        assert memory is not None
        if state == "running" and memory.ready is not None:
            self._monitor(memory.ready)
        self._publish(state)

    def _monitor(self, container_id: str) -> None:
        """Wake the loop the moment the engine's container exits (docker wait, no polling)."""
        if self._monitored == container_id:
            return
        self._monitored = container_id

        def watch() -> None:
            self.runtime.wait(container_id)
            if self._monitored == container_id:
                self._monitored = None
            self._pending = True
            self._wake.set()

        threading.Thread(target=watch, name="exit-monitor", daemon=True).start()

    def _show_refusal(self) -> None:
        """Say at once that desired.json is refused (or no longer is). Nothing else changes:
        neither the engine nor docker is asked anything on account of refused input."""
        current = self.heartbeat.status
        if current is None:
            return  # the first reconcile reports it
        message = current.message
        if self.refused:
            message = f"request refused: {self.refused}"
        elif message.startswith("request refused:"):
            message = "desired.json is valid again"
        self.heartbeat.set(current.generation, current.state, message, current.url, self.refused)

    def _publish(self, state: State | None = None) -> None:
        """Write the settled answer (or the current one again) and the file_sd file."""
        memory = self.memory
        if memory is None:
            return
        if self.task is not None:
            self._report_task(self.task)
            return
        state = state or (self.heartbeat.status.state if self.heartbeat.status else "starting")
        url = None
        if state == "running":
            endpoint = self.engine.endpoint()
            url = endpoint.url
            message = f"serving at {url}" + (f"; {notes}" if (notes := self.engine.notes()) else "")
            self.file_sd.publish(self.engine.targets(endpoint))
        else:
            self.file_sd.publish(None)
            message = memory.failure if state == "failed" and memory.failure else state
        self._report(state, message, url)

    def _report(self, state: State, message: str, url: str | None = None) -> None:
        generation = self.memory.generation if self.memory else 0
        if self.refused:
            message = (
                f"request refused: {self.refused}"
                if state in ("running", "stopped", "failed")
                else message
            )
        if state in ("stopping", "stopped", "failed"):
            self.file_sd.publish(None)
        self.heartbeat.set(generation, state, message, url, self.refused)

    def _report_unrequested(self, observed: Observed | None) -> None:
        container = observed.container if observed else None
        running = container is not None and container.running
        note = "no valid request in desired.json; the engine is left as it is"
        if self.refused:
            note = f"request refused: {self.refused}"
        self.file_sd.publish(None)
        self.heartbeat.set(0, "running" if running else "stopped", note, None, self.refused)


def _with_tail(message: str, runtime: Runtime, container_id: str) -> str:
    try:
        tail = actions.last_lines(runtime, container_id)
    except Transient:
        return message
    return f"{message}: {tail}" if tail else message
