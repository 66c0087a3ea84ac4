"""The eight measurements of issue 6, each against a baseline measured in the same run."""

from __future__ import annotations

import contextlib
import os
import queue
import random
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker.errors
from watchfiles import watch

from supervisor.protocol import host

from .lab import PYTHON, RUN_ID, Engine, Lab, StatusWatch, Timeout, answers, epoch, floor_ms
from .procfs import CLK_TCK, cpu_seconds, percentile, processes, pss_mb, rss_mb, tree
from .report import Row, num, overhead, ratio, summary, verdict

MS = 1000.0
HEARTBEAT = 15.0  # the worker's default heartbeat interval (supervisor/cli.py)


@dataclass(frozen=True)
class Plan:
    """Sample counts and windows: the full suite, or --quick for a smoke test."""

    quick: bool

    def pick(self, full: Any, quick: Any) -> Any:
        return quick if self.quick else full

    @property
    def acks(self) -> int:
        return int(self.pick(200, 30))

    @property
    def cycles(self) -> int:
        return int(self.pick(10, 3))

    @property
    def adoptions(self) -> int:
        return int(self.pick(5, 2))

    @property
    def idle_seconds(self) -> float:
        return float(self.pick(60, 10))

    @property
    def heartbeat_seconds(self) -> int:
        return int(self.pick(180, 20))

    @property
    def cancels(self) -> int:
        return int(self.pick(5, 2))

    @property
    def scale_workers(self) -> int:
        return int(self.pick(20, 5))

    @property
    def scale_rounds(self) -> int:
        return int(self.pick(10, 2))

    @property
    def burst_rounds(self) -> int:
        return int(self.pick(5, 2))

    @property
    def scale_idle_seconds(self) -> float:
        return float(self.pick(15, 5))

    @property
    def slow_build(self) -> int:
        """ARG SLOW of the slow engine: longer than anything the bench waits for."""
        return self.heartbeat_seconds + 600


@dataclass
class Cycles:
    ready: list[float] = field(default_factory=list)
    ready_base: list[float] = field(default_factory=list)
    gone: list[float] = field(default_factory=list)
    stopped: list[float] = field(default_factory=list)
    stop_base: list[float] = field(default_factory=list)


@dataclass
class Shared:
    """Figures one measurement takes from another."""

    ack_p99: float | None = None
    idle_rss: float | None = None
    idle_base_rss: float | None = None
    cycles: Cycles | None = None


# -- 1. acknowledgement ------------------------------------------------------------------------


def worker_watch_settings() -> dict[str, int]:
    """The keyword arguments supervisor/worker.py passes to watchfiles.watch, so that the
    baseline always listens exactly as the worker does."""
    from supervisor.worker import loop as worker

    return {
        "debounce": worker.WATCH_DEBOUNCE_MS,
        "step": worker.WATCH_STEP_MS,
        "rust_timeout": worker.WATCH_RUST_TIMEOUT_MS,
    }


class Listener:
    """The baseline: a bare watchfiles listener, in a thread, with the worker's own settings
    (supervisor/worker.py's WATCH_* settings; desired.json only)."""

    def __init__(self, lab: Lab) -> None:
        self.data = lab.tmp / "listener"
        self.name = "listener"
        self.directory = host.engine_dir(self.data, self.name)
        self.directory.mkdir(parents=True)
        self.wakes: queue.Queue[float] = queue.Queue()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._listen, name="listener", daemon=True)
        self.settings = worker_watch_settings()

    def _listen(self) -> None:
        for _ in watch(
            self.directory,
            stop_event=self.stop,
            watch_filter=lambda _c, path: path.endswith(host.DESIRED),
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


# -- 2 and 3. ready overhead, stop latency -----------------------------------------------------


def _worker_stop(lab: Lab, engine: Engine, status: StatusWatch) -> tuple[float, float]:
    """request stopped -> container gone (inspect NotFound), and -> status stopped."""
    status.poll()
    started = time.perf_counter()
    generation = engine.request("stopped")
    gone = stopped = None
    while gone is None or stopped is None:
        if gone is None:
            try:
                lab.client.api.inspect_container(engine.container)
            except docker.errors.NotFound:
                gone = time.perf_counter() - started
        if stopped is None:
            status.poll()
            if status.doc is not None and answers(generation, "stopped")(status.doc):
                stopped = time.perf_counter() - started
        if time.perf_counter() - started > 120:
            raise Timeout(f"stop: container gone={gone} status={status.doc}")
        time.sleep(0.002)
    return gone, stopped


def _worker_start(engine: Engine, status: StatusWatch) -> float:
    status.poll()
    started = time.perf_counter()
    generation = engine.request("running")
    doc, ready = status.wait(answers(generation, "running", "failed"), 120)
    if doc.get("state") != "running":
        raise RuntimeError(f"start failed: {doc.get('message')}\n{engine.log_tail()}")
    return ready - started


def _docker_run(lab: Lab, image: str, env: dict[str, str], port: int, index: int) -> Any:
    """The engine's own readiness: create+start of the same image, same network and publish,
    then GET the ready path every 10 ms until it answers 200."""
    gateway = lab.gateway()
    url = f"http://{gateway}:{port}/v1/models"
    started = time.perf_counter()
    container = lab.client.containers.run(
        image,
        name=f"lucia-bench-{RUN_ID}-ready-{index}",
        detach=True,
        environment=env,
        labels=lab.labels("baseline"),
        ports={f"{port}/tcp": (gateway, port)},
        network=lab.network,
    )
    while True:
        with (
            contextlib.suppress(urllib.error.URLError, OSError),
            urllib.request.urlopen(url, timeout=1) as response,
        ):
            if response.status == 200:
                return time.perf_counter() - started, container
        if time.perf_counter() - started > 60:
            raise Timeout(f"baseline container never answered {url}")
        time.sleep(0.01)


def _docker_stop(lab: Lab, container: Any) -> float:
    """docker stop (same 60 s grace as the recipe) + docker rm, until inspect says NotFound."""
    started = time.perf_counter()
    container.stop(timeout=60)
    container.remove()
    while True:
        try:
            lab.client.api.inspect_container(container.id)
        except docker.errors.NotFound:
            return time.perf_counter() - started
        time.sleep(0.002)


def _cycles(lab: Lab, plan: Plan, shared: Shared) -> Cycles:
    if shared.cycles is not None:
        return shared.cycles
    engine = lab.main()
    image = lab.client.images.get(engine.image_tag + "-grammar").id
    port = lab.free_port()
    env = {**engine.environment, "PORT": str(port)}
    status = engine.watch()
    cycles = Cycles()
    for index in range(plan.cycles):  # interleaved, so that machine noise hits both alike
        gone, stopped = _worker_stop(lab, engine, status)
        cycles.gone.append(gone * MS)
        cycles.stopped.append(stopped * MS)
        cycles.ready.append(_worker_start(engine, status) * MS)
        ready, container = _docker_run(lab, image, env, port, index)
        cycles.ready_base.append(ready * MS)
        cycles.stop_base.append(_docker_stop(lab, container) * MS)
    shared.cycles = cycles
    return cycles


def ready(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    c = _cycles(lab, plan, shared)
    p50, high = summary(c.ready)
    b50, b_high = summary(c.ready_base)
    extra = p50 - b50
    return [
        Row(
            "ready",
            "request running -> status running (images built, READY_DELAY=0)",
            "ms",
            p50,
            high,
            len(c.ready),
            f"{num(b50, 'ms')} p50 (docker run -> first 200)",
            overhead(p50, b50, "ms"),
            "overhead < 300 ms",
            verdict(extra < 300),
            "Overhead = p50 minus the baseline's p50; ratio of the p50s. Baseline: create+start "
            "of the same grammar image, same network, same gateway-only publish (what "
            "`docker run -d` sends), then GET the ready path every 10 ms; its max "
            f"{num(b_high, 'ms')}. Samples alternate with the baseline's, one each per cycle.",
        )
    ]


def stop(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    c = _cycles(lab, plan, shared)
    p50, high = summary(c.gone)
    b50, b_high = summary(c.stop_base)
    s50, s_high = summary(c.stopped)
    return [
        Row(
            "stop",
            "request stopped -> container gone (inspect NotFound)",
            "ms",
            p50,
            high,
            len(c.gone),
            f"{num(b50, 'ms')} p50 (docker stop + docker rm)",
            overhead(p50, b50, "ms"),
            note="Container polled with docker inspect every ~2 ms. Baseline: stop (60 s grace, "
            "the engine exits on SIGTERM) and rm of an equivalent container, same poll; its "
            f"max {num(b_high, 'ms')}.",
        ),
        Row(
            "stop",
            "request stopped -> status stopped",
            "ms",
            s50,
            s_high,
            len(c.stopped),
            f"{num(b50, 'ms')} p50 (docker stop + docker rm)",
            overhead(s50, b50, "ms"),
        ),
    ]


# -- 4. adoption -------------------------------------------------------------------------------


def adoption(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    engine = lab.main()
    generation = int((engine.status() or {})["generation"])
    api = lab.client.api
    times, shutdowns, base, adopted_rss = [], [], [], []
    restarts = flaps = 0
    for _ in range(plan.adoptions):
        before = api.inspect_container(engine.container)
        shutdowns.append(engine.stop_worker() * MS)
        since = floor_ms(time.time())
        started = time.perf_counter()
        engine.start_worker()
        states: list[str] = []

        def current(doc: dict[str, Any], since: float = since, states: list[str] = states) -> bool:
            if epoch(doc["checkedAt"]) >= since:
                states.append(str(doc.get("state")))
            return (
                doc.get("generation") == generation
                and doc.get("state") == "running"
                and epoch(doc["checkedAt"]) >= since
            )

        _, adopted = engine.watch().wait(current, 60)
        times.append((adopted - started) * MS)
        flaps += any(state != "running" for state in states)
        after = api.inspect_container(engine.container)
        restarts += int(after["Id"] != before["Id"])
        restarts += int(after["State"]["StartedAt"] != before["State"]["StartedAt"])
        restarts += int(after["RestartCount"]) - int(before["RestartCount"])
        time.sleep(1)
        adopted_rss.append(rss_mb(engine.proc.pid) if engine.proc is not None else 0.0)
        began = time.perf_counter()
        subprocess.run([PYTHON, "-c", "import supervisor.worker.loop"], check=True)
        base.append((time.perf_counter() - began) * MS)
    p50, high = summary(times)
    b50, _ = summary(base)
    d50, d_high = summary(shutdowns)
    note = (
        "New worker process started (Popen) -> status.json says the same generation, 'running', "
        "with a checkedAt after the restart. Restarts = changed container id + changed "
        "State.StartedAt + RestartCount increase, summed over all samples. Baseline: wall time "
        "of `python -c 'import supervisor.worker'` (interpreter + imports). The old worker "
        f"exited {num(d50, 'ms')} p50 (max {num(d_high, 'ms')}) after its SIGTERM. RSS of the "
        f"adopted worker (it has built nothing since it started) 1 s after: "
        f"{num(max(adopted_rss), 'MB')} max."
    )
    if flaps:
        note += (
            f" In {flaps} of {len(times)} restarts the status said 'starting' for the running "
            "engine before it said 'running' again (the restart re-acknowledges the request)."
        )
    return [
        Row(
            "adoption",
            f"worker restart -> status current again; container restarts: {restarts}",
            "ms",
            p50,
            high,
            len(times),
            f"{num(b50, 'ms')} p50 (python -c 'import supervisor.worker')",
            overhead(p50, b50, "ms"),
            "< 1 s, 0 restarts",
            verdict(high < 1000 and restarts == 0),
            note,
        )
    ]


# -- 5. idle footprint -------------------------------------------------------------------------

IDLE_BASELINE = (
    "import docker, pydantic, watchfiles, structlog, prometheus_client, time\n"
    "print('ready', flush=True)\n"
    "time.sleep(3600)\n"
)


def idle(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    engine = lab.main()
    assert engine.proc is not None
    pid = engine.proc.pid
    base = lab.spawn([PYTHON, "-c", IDLE_BASELINE], stdout=subprocess.PIPE)
    assert base.stdout is not None
    base.stdout.readline()  # its imports are done
    time.sleep(1)
    window = plan.idle_seconds
    cpu_w, cpu_b = cpu_seconds(pid), cpu_seconds(base.pid)
    started = time.perf_counter()
    rss_w: list[float] = []
    rss_b: list[float] = []
    ages: list[float] = []
    next_rss = started
    while (now := time.perf_counter()) - started < window:
        if now >= next_rss:
            rss_w.append(rss_mb(pid))
            rss_b.append(rss_mb(base.pid))
            next_rss += 1.0
        doc = engine.status()
        if doc is not None:
            ages.append(time.time() - epoch(doc["checkedAt"]))
        time.sleep(0.1)
    elapsed = time.perf_counter() - started
    cpu_w = (cpu_seconds(pid) - cpu_w) / elapsed * 100
    cpu_b = (cpu_seconds(base.pid) - cpu_b) / elapsed * 100
    pss_w, pss_b = pss_mb(pid), pss_mb(base.pid)
    names = [
        f"`{name}` {num(rss_mb(p, children=False), 'MB')}"
        for p, name in zip(tree(pid), processes(pid), strict=False)
    ]
    base.kill()
    base.wait()
    w50, w_max = summary(rss_w)
    b50, _ = summary(rss_b)
    shared.idle_rss = w50
    shared.idle_base_rss = b50
    a50, a_max = percentile(ages, 0.5), max(ages)
    return [
        Row(
            "idle",
            "worker RSS, engine running (VmRSS, incl. children)",
            "MB",
            w50,
            w_max,
            len(rss_w),
            f"{num(b50, 'MB')} p50 (python importing the same modules, asleep)",
            overhead(w50, b50, "MB"),
            "RSS < 60 MB",
            verdict(w_max < 60),
            f"Sampled every 1 s over {window:.0f} s from /proc/PID/status. Processes: "
            f"{'; '.join(names)}. PSS (shared pages split): worker {num(pss_w, 'MB')}, "
            f"baseline {num(pss_b, 'MB')}. 1 MB = 10^6 bytes.",
        ),
        Row(
            "idle",
            f"worker CPU over {window:.0f} s, % of one core",
            "%",
            cpu_w,
            None,
            1,
            f"{num(cpu_b, '%')} (the same sleeping python)",
            f"{'+' if cpu_w >= cpu_b else ''}{num(cpu_w - cpu_b, '%')}",
            "CPU < 0.5 %",
            verdict(cpu_w < 0.5),
            "utime+stime deltas from /proc/PID/stat (children included), over the window's "
            f"wall time; clock tick {1 / CLK_TCK:.2f} s.",
        ),
        Row(
            "idle",
            "status age polled every 100 ms while settled (running)",
            "s",
            a50,
            a_max,
            len(ages),
            f"{HEARTBEAT:g} s (heartbeat interval)",
            f"max {ratio(a_max, HEARTBEAT)}",
            "never above 20 s",
            verdict(a_max <= 20),
            always_max=True,
        ),
    ]


# -- 6. heartbeat during a slow build ----------------------------------------------------------


def heartbeat(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    seconds = plan.heartbeat_seconds
    engine = lab.slow(plan.slow_build)
    status = engine.watch()
    generation = engine.request("running")
    status.wait(answers(generation), 30)
    ages: list[float] = []
    writes: set[str] = set()
    building = 0
    tick = started = time.perf_counter()
    doc: dict[str, Any] = {}
    while time.perf_counter() - started < seconds:
        doc = engine.status() or doc
        if doc:
            ages.append(time.time() - epoch(doc["checkedAt"]))
            writes.add(doc["checkedAt"])
            building += "compiling kernels" in str(doc.get("message"))
        tick += 0.1
        time.sleep(max(tick - time.perf_counter(), 0))
    lab.slow_building = doc.get("state") == "starting" and "compiling" in str(doc.get("message"))
    p50, high = percentile(ages, 0.5), max(ages)
    return [
        Row(
            "heartbeat",
            f"status age polled every 100 ms during a {seconds} s slow build",
            "s",
            p50,
            high,
            len(ages),
            f"{HEARTBEAT:g} s (configured heartbeat)",
            f"max {ratio(high, HEARTBEAT)}",
            "never above 20 s",
            verdict(high <= 20),
            f"Build of the recipe image with build arg SLOW={plan.slow_build} (one 'compiling "
            f"kernels' line a second); the worker at its default heartbeat. {len(writes)} "
            f"distinct status writes seen in {seconds} s; {building} of {len(ages)} reads "
            f"showed the build's progress line. Last message: {doc.get('message')!r}.",
            always_max=True,
        )
    ]


# -- 7. cancel ---------------------------------------------------------------------------------


def _docker_kill(lab: Lab, index: int) -> float:
    container = lab.client.containers.run(
        lab.base_image(),
        ["sleep", "3600"],
        name=f"lucia-bench-{RUN_ID}-kill-{index}",
        detach=True,
        labels=lab.labels("baseline"),
    )
    api = lab.client.api
    started = time.perf_counter()
    api.kill(container.id)
    while api.inspect_container(container.id)["State"]["Running"]:
        time.sleep(0.002)
    took = time.perf_counter() - started
    container.remove(force=True)
    return took


def _wait_build_container(lab: Lab, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not lab.build_containers():
        if time.monotonic() > deadline:
            raise Timeout("no build step container appeared")
        time.sleep(0.05)


class _Abandoned(threading.Thread):
    """Lists the build's step containers every ~10 ms, in a thread of its own so that the
    status poll beside it keeps its 1 ms resolution."""

    def __init__(self, lab: Lab, started: float) -> None:
        super().__init__(name="abandoned", daemon=True)
        self.lab, self.started = lab, started
        self.at: float | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while self.lab.build_containers():
                if time.perf_counter() - self.started > 60:
                    raise Timeout("the build step container is still running after 60 s")
                time.sleep(0.01)
            self.at = time.perf_counter()
        except BaseException as exc:
            self.error = exc

    def result(self) -> float:
        self.join(90)
        if self.at is None:
            raise self.error or Timeout("the build step container watch did not finish")
        return self.at


def _abandoned(lab: Lab, started: float) -> _Abandoned:
    thread = _Abandoned(lab, started)
    thread.start()
    return thread


def cancel(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    engine = lab.slow(plan.slow_build)
    status = engine.watch()
    to_stopped, to_abandoned = [], []
    for _ in range(plan.cancels):
        if not lab.slow_building:
            generation = engine.request("running")

            def building(doc: dict[str, Any], generation: int = generation) -> bool:
                return answers(generation)(doc) and "compiling kernels" in str(doc["message"])

            engine.wait(building, 120, "the slow build")
        _wait_build_container(lab)
        status.poll()
        started = time.perf_counter()
        generation = engine.request("stopped")
        abandoned = _abandoned(lab, started)
        doc, stopped = status.wait(answers(generation, "stopped", "failed"), 60)
        if doc.get("state") != "stopped":
            raise RuntimeError(f"cancel ended {doc.get('state')}: {doc.get('message')}")
        to_abandoned.append((abandoned.result() - started) * MS)
        to_stopped.append((stopped - started) * MS)
        lab.slow_building = False
    deadline = time.monotonic() + 15
    while lab.build_containers(running_only=False) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = len(lab.build_containers(running_only=False))
    try:
        lab.client.images.get(engine.image_tag)
        image = "an image WAS produced"
    except docker.errors.ImageNotFound:
        image = "no image was produced"
    base = [_docker_kill(lab, i) * MS for i in range(plan.cancels)]
    p50, high = summary(to_stopped)
    a50, a_high = summary(to_abandoned)
    b50, _ = summary(base)
    return [
        Row(
            "cancel",
            "request stopped during a build -> status stopped",
            "ms",
            p50,
            high,
            len(to_stopped),
            f"{num(b50, 'ms')} p50 (docker kill -> not running)",
            overhead(p50, b50, "ms"),
            "< 1 s",
            verdict(high < 1000),
            "The build is the recipe image's ARG SLOW loop, cancelled once it prints "
            "'compiling kernels'. Detection of status: 1 ms poll.",
        ),
        Row(
            "cancel",
            "request stopped during a build -> no build container running",
            "ms",
            a50,
            a_high,
            len(to_abandoned),
            f"{num(b50, 'ms')} p50 (docker kill -> not running)",
            overhead(a50, b50, "ms"),
            note="Build step containers of this run listed every ~10 ms (label inherited from "
            f"the bench's base image, command of the SLOW loop). Afterwards: {left} build "
            f"containers left (any state), {image}.",
        ),
    ]


# -- 8. scale ----------------------------------------------------------------------------------


def _all_running(engines: list[Engine], generations: dict[str, int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = {e.name: e for e in engines}
    while pending:
        for name, engine in list(pending.items()):
            doc = engine.status()
            if doc and answers(generations[name], "running", "failed")(doc):
                if doc["state"] == "failed":
                    raise RuntimeError(f"{name} failed: {doc['message']}")
                del pending[name]
        if time.monotonic() > deadline:
            first = next(iter(pending.values()))
            raise Timeout(f"{len(pending)} engines not running; {first.name}: {first.log_tail()}")
        time.sleep(0.05)


def _burst(engines: list[Engine], watches: dict[str, StatusWatch]) -> list[float]:
    """Request all engines at once; each one's request -> acknowledgement.

    A poller thread watches every requested engine's status.json (1 ms) while the requests are
    still being written, so that an early worker's answer is not seen only after the last write.
    """
    before: dict[str, int] = {}
    for engine in engines:
        status = watches[engine.name]
        status.poll()
        before[engine.name] = int((status.doc or {}).get("generation", 0))
    started: dict[str, float] = {}
    acked: dict[str, float] = {}
    give_up = threading.Event()

    def poll() -> None:
        while len(acked) < len(engines) and not give_up.is_set():
            for name in list(started):
                status = watches[name]
                if (
                    name not in acked
                    and status.poll()
                    and int((status.doc or {}).get("generation", 0)) > before[name]
                ):
                    acked[name] = time.perf_counter()
            time.sleep(0.001)

    poller = threading.Thread(target=poll, name="burst-poller", daemon=True)
    poller.start()
    generations: dict[str, int] = {}
    for engine in engines:
        started[engine.name] = time.perf_counter()
        generations[engine.name] = engine.request("running")
    poller.join(30)
    give_up.set()
    if len(acked) < len(engines):
        raise Timeout(f"not acknowledged: {sorted(set(started) - set(acked))}")
    _all_running(engines, generations, 60)
    return [(acked[name] - started[name]) * MS for name in started]


def _stop_all(lab: Lab, engines: list[Engine]) -> None:
    for engine in engines:
        if engine.proc is not None and engine.proc.poll() is None:
            engine.proc.send_signal(signal.SIGTERM)
    for engine in engines:
        if engine.proc is not None:
            engine.proc.wait(30)
        with contextlib.suppress(docker.errors.NotFound):
            lab.client.api.remove_container(engine.container, force=True)


def scale(lab: Lab, plan: Plan, shared: Shared) -> list[Row]:
    main = lab.main()  # also builds the images all the workers share
    single = shared.ack_p99
    single_note = "from the ack measurement"
    if single is None:
        status = main.watch()
        single = summary([ack_sample(main, status).ack * MS for _ in range(50)])[1]
        single_note = "50 requests to the main engine, measured here"
    count = plan.scale_workers
    engines = [lab.engine(f"s{i:02d}", prepare=False) for i in range(count)]
    try:
        began = time.perf_counter()
        for engine in engines:
            engine.start_worker()
        _all_running(engines, {e.name: e.request("running") for e in engines}, 300)
        startup = time.perf_counter() - began
        watches = {e.name: e.watch() for e in engines}
        pids = [e.proc.pid for e in engines if e.proc is not None]
        sequential = [
            ack_sample(engine, watches[engine.name]).ack * MS
            for _ in range(plan.scale_rounds)
            for engine in engines
        ]
        cpu0 = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        burst = [a for _ in range(plan.burst_rounds) for a in _burst(engines, watches)]
        burst_cpu = sum(cpu_seconds(p) for p in pids) - cpu0
        burst_wall = time.perf_counter() - t0
        time.sleep(2)
        rss = [rss_mb(e.proc.pid) for e in engines if e.proc is not None]
        pss = [pss_mb(e.proc.pid) for e in engines if e.proc is not None]
        cpu0 = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        time.sleep(plan.scale_idle_seconds)
        cpu = (sum(cpu_seconds(p) for p in pids) - cpu0) / (time.perf_counter() - t0) * 100
    finally:
        _stop_all(lab, engines)
    s50, s99 = summary(sequential)
    u50, u99 = summary(burst)
    total = sum(rss)
    base_rss = (
        f"{count} x {num(shared.idle_base_rss, 'MB')} (the idle baseline python) = "
        f"{num(count * shared.idle_base_rss, 'MB')}"
        if shared.idle_base_rss
        else "-"
    )
    return [
        Row(
            "scale",
            f"ack with {count} workers, one request at a time ({plan.scale_rounds} each)",
            "ms",
            s50,
            s99,
            len(sequential),
            f"{num(single, 'ms')} p99 with 1 worker",
            "p99 " + ratio(s99, single),
            "p99 < 50 ms",
            verdict(s99 < 50),
            f"{count} workers (own engine, port, data and state directories; one shared image), "
            f"started and running in {startup:.1f} s. Baseline p99 {single_note}.",
        ),
        Row(
            "scale",
            f"ack with all {count} requested at once ({plan.burst_rounds} bursts)",
            "ms",
            u50,
            u99,
            len(burst),
            f"{num(single, 'ms')} p99 with 1 worker",
            "p99 " + ratio(u99, single),
            "p99 < 50 ms",
            verdict(u99 < 50),
            "Each worker's time counts from the start of its own request write; the writes "
            "follow each other as fast as host.request() goes, while a poller thread watches "
            "every status.json at 1 ms. The workers used "
            f"{num(burst_cpu / len(burst) * MS, 'ms')} of CPU per request, "
            f"{num(burst_cpu / burst_wall * 100, '%')} of one core over the bursts "
            f"(this machine has {os.cpu_count()} cores).",
        ),
        Row(
            "scale",
            f"total RSS of {count} idle workers (sum of VmRSS)",
            "MB",
            total,
            max(rss),
            count,
            base_rss,
            ratio(total, count * shared.idle_base_rss) if shared.idle_base_rss else "-",
            note=f"p50 column: the total; p99/max column: the largest worker. These workers "
            "built nothing (the image was built once, by the main engine's worker). Total PSS "
            f"(shared pages split) {num(sum(pss), 'MB')}. The {count} workers together used "
            f"{num(cpu, '%')} of one core while idle over {plan.scale_idle_seconds:.0f} s.",
        ),
    ]


MEASUREMENTS = {
    "ack": acknowledgement,
    "ready": ready,
    "stop": stop,
    "adoption": adoption,
    "idle": idle,
    "heartbeat": heartbeat,
    "cancel": cancel,
    "scale": scale,
}
