"""1. Acknowledgement: request -> status.json answers the generation.

Baseline: a bare watchfiles listener with the worker's own settings.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from watchfiles import watch

from supervisor.host import protocol as host
from supervisor.protocol import layout

from ..engine import Engine
from ..lab import Lab
from ..procfs import cpu_seconds, percentile
from ..report import Row, num, overhead, summary, verdict
from ..status import StatusWatch, answers
from .common import MS, Plan, Shared


def worker_watch_settings() -> dict[str, int]:
    """The keyword arguments supervisor/worker/wakeup.py passes to watchfiles.watch, so that
    the baseline always listens exactly as the worker does."""
    from supervisor.worker import wakeup

    return {
        "debounce": wakeup.WATCH_DEBOUNCE_MS,
        "step": wakeup.WATCH_STEP_MS,
        "rust_timeout": wakeup.WATCH_RUST_TIMEOUT_MS,
    }


class Listener:
    """The baseline: a bare watchfiles listener, in a thread, with the worker's own settings
    (supervisor/worker/wakeup.py's WATCH_* settings; desired.json only)."""

    def __init__(self, lab: Lab) -> None:
        self.data = lab.tmp / "listener"
        self.name = "listener"
        self.directory = layout.engine_dir(self.data, self.name)
        self.directory.mkdir(parents=True)
        self.wakes: queue.Queue[float] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._listen, name="listener", daemon=True)
        self.settings = worker_watch_settings()

    def _listen(self) -> None:
        for _ in watch(
            self.directory,
            stop_event=self.stop,
            watch_filter=lambda _c, path: path.endswith(layout.DESIRED),
            **self.settings,
        ):
            self.wakes.put(time.perf_counter())

    def __enter__(self) -> Listener:
        self.thread.start()
        for _ in range(50):  # until the watch is set up and answering
            host.request(self.data, self.name, "running")
            with contextlib.suppress(queue.Empty):
                self.wakes.get(timeout=0.2)
                break
        time.sleep(0.1)
        self._drain()
        return self

    def _drain(self) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                self.wakes.get_nowait()

    def sample(self) -> float:
        self._drain()
        started = time.perf_counter()
        host.request(self.data, self.name, "running")
        return self.wakes.get(timeout=5) - started

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(3)


@dataclass
class AckSample:
    ack: float  # request -> status with the generation
    settled: float  # request -> status running again
    write: float  # the host.request() call itself
    first_state: str  # the state the first answer carried


def ack_sample(engine: Engine, status: StatusWatch) -> AckSample:
    status.poll()
    started = time.perf_counter()
    generation = engine.request("running")
    written = time.perf_counter()
    doc, acked = status.wait(answers(generation), 15)
    first = str(doc.get("state"))
    doc, settled = status.wait(answers(generation, "running", "failed"), 60, interval=0.002)
    if doc.get("state") != "running":
        raise RuntimeError(f"{engine.name} failed: {doc.get('message')}")
    return AckSample(acked - started, settled - started, written - started, first)


def _inode(path: Path) -> int:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return 0


def acknowledgement(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    engine = lab.main()
    status = engine.watch()
    samples: list[AckSample] = []
    base: list[float] = []
    assert engine.proc is not None
    cpu = cpu_seconds(engine.proc.pid)
    file_sd = engine.data_dir / "telemetry" / f"{engine.name}.json"
    rewritten = 0
    with Listener(lab) as listener:
        settings = ", ".join(f"{k}={v}" for k, v in listener.settings.items())
        for _ in range(plan.acks):
            before = _inode(file_sd)
            samples.append(ack_sample(engine, status))
            rewritten += _inode(file_sd) != before
            base.append(listener.sample())
            time.sleep(random.uniform(0.005, 0.025))  # no lock-step with the worker's timers
    per_request = (cpu_seconds(engine.proc.pid) - cpu) / len(samples) * MS
    acks = [s.ack * MS for s in samples]
    p50, p99 = summary(acks)
    b50, b99 = summary([b * MS for b in base])
    shared.ack_p99 = p99
    writes = [s.write * MS for s in samples]
    settled = [s.settled * MS for s in samples]
    missed = sum(1 for s in samples if s.first_state != "starting")
    note = (
        "status.json detected by a tight poll (stat() every 1 ms, content parsed and checked "
        "for the generation); t0 is taken before supervisor.host.request(), whose own "
        f"locked, fsync'd atomic write takes p50 {num(percentile(writes, 0.5), 'ms')} "
        f"(p99 {num(percentile(writes, 0.99), 'ms')}) and is inside both figures. "
        f"Baseline p50 {num(b50, 'ms')}, p99 {num(b99, 'ms')}, with the worker's watch settings "
        f"{settings}. The running engine's re-request "
        "is answered 'starting', then 'running' again after one readiness probe: request -> "
        f"running p50 {num(percentile(settled, 0.5), 'ms')}, p99 "
        f"{num(percentile(settled, 0.99), 'ms')}. Worker CPU per request (utime+stime): "
        f"{num(per_request, 'ms')}. The engine's file_sd file (telemetry/<name>.json) was "
        f"rewritten during {rewritten} of {len(samples)} re-requests of the running engine."
    )
    if missed:
        note += f" In {missed} samples the first status seen already said 'running'."
    return [
        Row(
            "ack",
            "request -> status.json answers the generation",
            "ms",
            p50,
            p99,
            len(acks),
            f"{num(b50, 'ms')} p50 / {num(b99, 'ms')} p99 (watchfiles wake)",
            "p99 " + overhead(p99, b99, "ms"),
            "p99 < 50 ms",
            verdict(p99 < 50),
            note,
        )
    ]
