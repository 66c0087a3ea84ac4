"""The worker loop with remembered failures: shown, tried again after a growing back-off, and
never claiming that a serving engine failed. Fakes at the runtime and engine boundary (fast);
the real case against dockerd is in tests/conformance/test_worker_rules.py."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from supervisor.docker import labels
from supervisor.docker.spec import Container, RunSpec
from supervisor.engines.base import EngineInfo, Observed, Prerequisite, StepContext
from supervisor.engines.loader import parse
from supervisor.errors import Blocked, Permanent
from supervisor.protocol.documents import TargetGroup
from supervisor.recipe.schema import RecipeError
from supervisor.worker import loop
from supervisor.worker.plan import Answer
from supervisor.worker.pursuit import BACKOFF
from tests.unit.test_recipe import IPC_HOST_SHM

BOOM = "stopping container c1: 500 Server Error: the daemon is sick"
TAKEN = "port 9001 on 172.30.0.1 is taken by another program"
ARGS = "the engine's own check refused the recipe's arguments (exit 2): --kv-dtpye"
SPEC = RunSpec(
    name="lucia-x",
    image="sha256:" + "a" * 64,
    network="lucia",
    host_ip="172.30.0.1",
    host_port=9000,
    container_port=8888,
    labels={labels.MANAGED: "true", labels.NAME: "x", labels.IMAGE_REF: "img"},
)
MOVED = replace(SPEC, host_port=9001)


def _container(cid: str, spec: RunSpec) -> Container:
    return Container(
        id=cid,
        name="lucia-x",
        image_id=spec.image,
        status="running",
        exit_code=0,
        oom_killed=False,
        started_at="t",
        labels={**spec.labels, labels.FINGERPRINT: spec.fingerprint()},
        bindings=((spec.host_ip, spec.host_port),),
    )


@dataclass
class FakeRuntime:
    """Docker as the worker's steps see it: one container, and stops that fail on demand."""

    container: Container | None = None
    stop_failures: int = 0
    stops: list[float] = field(default_factory=list)
    made: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def stop(self, container_id: str, grace: float) -> None:
        self.stops.append(time.monotonic())
        if len(self.stops) <= self.stop_failures:
            raise Permanent(BOOM)

    def remove(self, container_id: str) -> None:
        with self.lock:
            self.container = None

    def run(self, spec: RunSpec) -> Container:
        with self.lock:
            self.made += 1
            self.container = _container(f"c{self.made + 1}", spec)
            return self.container

    def wait(self, container_id: str) -> int | None:
        threading.Event().wait()  # the exit monitor: these containers never exit by themselves
        return None


INFO = EngineInfo(
    "fake",
    "lucia-x",
    stop_grace=1.0,
    ready_timeout=10.0,
    poll_interval=30.0,
    models=("fake-model",),
)


@dataclass
class FakeEngine:
    """An engine whose container is the fake runtime's, and whose Check fails on demand."""

    runtime: FakeRuntime
    spec: RunSpec = SPEC
    refusals: list[Exception] = field(default_factory=list)  # raised by the next Checks
    checks: list[float] = field(default_factory=list)
    info: EngineInfo = INFO

    def observe(self) -> Observed:
        container = self.runtime.container
        port = container.bindings[0][1] if container else self.spec.host_port
        url = f"http://172.30.0.1:{port}"
        return Observed(
            container=container,
            spec=self.spec,
            url=url,
            targets=(TargetGroup(targets=[f"172.30.0.1:{port}"], labels={}),),
            models=self.info.models,
        )

    def make(self, what: Prerequisite, ctx: StepContext) -> None:
        raise AssertionError("nothing is missing")

    def preflight(self, spec: RunSpec, replacing: str | None, ctx: StepContext) -> None:
        self.checks.append(time.monotonic())
        if self.refusals:
            raise self.refusals.pop(0)

    def settle(self, running: str | None, started: bool) -> None: ...

    def ready(self) -> bool:
        return True


@dataclass(frozen=True)
class Shown:
    state: str
    message: str
    targets: tuple[TargetGroup, ...]
    at: float


def _worker(
    tmp_path: Path,
    engine: FakeEngine,
    monkeypatch: pytest.MonkeyPatch,
    load: Callable[[], Any] = object,
) -> tuple[loop.Worker, list[Shown]]:
    monkeypatch.setattr(loop.registry, "create", lambda *args, **kwargs: engine)
    settings = loop.WorkerSettings("x", tmp_path / "data", tmp_path / "state", heartbeat=5.0)
    worker = loop.Worker(settings, load, engine.runtime)  # type: ignore[arg-type]
    shown: list[Shown] = []
    show = worker.heartbeat.show

    def record(answer: Answer, refused: str | None, targets: Any = ()) -> None:
        shown.append(Shown(answer.state, answer.message, tuple(targets), time.monotonic()))
        show(answer, refused, targets)

    monkeypatch.setattr(worker.heartbeat, "show", record)
    return worker, shown


def _request(worker: loop.Worker, generation: int, desired: str) -> None:
    path = worker.directory / "desired.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"schemaVersion": 1, "generation": generation, "desired": desired}))
    os.replace(tmp, path)


def _drive(worker: loop.Worker, script: Callable[[], None], timeout: float = 60) -> None:
    """Run the worker on this thread while script runs on another; stop it when script ends."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            script()
        except BaseException as exc:  # handed back to the test
            failure.append(exc)
        finally:
            worker._stop.set()
            worker._wake.set()

    threading.Thread(target=run, daemon=True).start()
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        worker.run()
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)
    if failure:
        raise failure[0]


@dataclass
class Clock:
    """The loop's monotonic clock, moved on by the test: the back-offs pass with no wait."""

    ahead: float = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


def _rounds(worker: loop.Worker, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Each time the loop goes to wait: whether it is idle then (no observation or step)."""
    rounds: list[bool] = []
    wait = worker._wake.wait

    def record(timeout: float) -> bool:
        rounds.append(worker.job is None)
        return wait(timeout)

    monkeypatch.setattr(worker._wake, "wait", record)
    return rounds


def _until(what: str, condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_a_stop_that_fails_for_good_is_failed_and_tried_again_after_a_growing_delay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = FakeRuntime(container=_container("c1", SPEC), stop_failures=2)
    worker, shown = _worker(tmp_path, FakeEngine(runtime), monkeypatch)

    def script() -> None:
        _request(worker, 1, "stopped")
        _until("stopped", lambda: bool(shown) and shown[-1].state == "stopped")

    _drive(worker, script)
    on_disk = json.loads(worker.heartbeat.path.read_text())
    assert (on_disk["state"], on_disk["models"]) == ("stopped", ["fake-model"])  # every state
    assert len(runtime.stops) == 3, runtime.stops  # two failures, then Docker was fixed
    first, second = (b - a for a, b in zip(runtime.stops, runtime.stops[1:], strict=False))
    assert first >= 1.0 and second >= 2.0, (first, second)  # never planned again at once
    failures = [s.message for s in shown if s.state == "failed"]
    assert f"{BOOM}; trying again in 1 s" in failures
    assert f"{BOOM}; trying again in 2 s" in failures
    assert not any("stopping the engine" in s.message for s in shown if s.state == "failed")


def test_a_refused_replacement_serves_on_and_goes_ahead_once_the_check_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime = FakeRuntime(container=_container("c1", SPEC))
    engine = FakeEngine(runtime)
    worker, shown = _worker(tmp_path, engine, monkeypatch)
    clock = Clock()
    monkeypatch.setattr(loop, "time", clock)
    rounds = _rounds(worker, monkeypatch)
    marks: dict[str, int] = {}

    def script() -> None:
        _request(worker, 1, "running")
        _until("serving", lambda: bool(shown) and shown[-1].message.startswith("serving at"))
        # the recipe now asks for a port the engine's own check refuses: for good, then a
        # reload, then twice held by another program, then free
        engine.spec = MOVED
        engine.refusals = [Permanent(ARGS), Blocked(TAKEN), Blocked(TAKEN)]
        marks["moved"] = len(shown)
        os.kill(os.getpid(), signal.SIGHUP)
        _until("the refusal", lambda: ARGS in shown[-1].message)
        # a refusal for good is not tried again: the loop's clock passes the first back-offs,
        # and once the loop has gone round on that clock and is idle, the Check ran only once
        clock.ahead += BACKOFF[0] + BACKOFF[1] + 0.5
        mark = len(rounds)
        worker._wake.set()
        _until("the loop idle after the back-offs", lambda: True in rounds[mark + 1 :])
        assert len(engine.checks) == 1, engine.checks
        marks["reload"] = len(shown)
        os.kill(os.getpid(), signal.SIGHUP)  # an operator's reload tries again at once
        _until(
            "the replacement",
            lambda: (
                runtime.container is not None
                and runtime.container.id == "c2"
                and shown[-1].state == "running"
            ),
        )

    _drive(worker, script)
    assert runtime.container is not None and runtime.container.bindings == (("172.30.0.1", 9001),)
    assert len(engine.checks) == 4
    _, reload_check, second, passed = engine.checks
    assert second - reload_check >= 1.0 and passed - second >= 2.0
    before_stop = [s for s in shown[marks["moved"] :] if s.at < passed]  # until the Check passed
    assert before_stop and all(s.state == "running" for s in before_stop), [
        (s.state, s.message) for s in before_stop if s.state != "running"
    ]
    assert all(s.targets[0].targets == ["172.30.0.1:9000"] for s in before_stop)
    messages = [s.message for s in before_stop]
    assert (
        "serving at http://172.30.0.1:9000; the replacement (its ports changed) was refused: "
        f"{ARGS}"
    ) in messages
    assert (
        "serving at http://172.30.0.1:9000; the replacement (its ports changed) was refused: "
        f"{TAKEN}; trying again in 1 s"
    ) in messages
    assert shown[-1].targets[0].targets == ["172.30.0.1:9001"]
    assert shown[-1].message == "serving at http://172.30.0.1:9001"


def _refusal(text: str) -> str:
    """What the real recipe loader says of a recipe text it refuses."""
    with pytest.raises(RecipeError) as refused:
        parse(text, "lucia-x.toml")
    return str(refused.value)


@pytest.mark.parametrize(
    "nvme",
    [
        "lucia-x.toml: tiers.nvme.path: '~/kv/nvme' must be an absolute path",
        _refusal(IPC_HOST_SHM),  # the shm offload in the host's /dev/shm
    ],
    ids=["a tier path", "the host ipc with an shm offload"],
)
def test_a_refused_recipe_reload_is_in_the_status_until_a_valid_one_is_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nvme: str
) -> None:
    runtime = FakeRuntime(container=_container("c1", SPEC))
    engine = FakeEngine(runtime)
    loads: list[Exception] = []  # what the next reloads raise; none: the recipe is valid

    def load() -> object:
        if loads:
            raise loads.pop(0)
        return object()

    worker, shown = _worker(tmp_path, engine, monkeypatch, load)
    serving = "serving at http://172.30.0.1:9000"
    refused = f"recipe reload refused (the recipe loaded before stays in use): {nvme}; {serving}"
    on_disk: list[dict[str, Any]] = []

    def script() -> None:
        _request(worker, 1, "running")
        _until("serving", lambda: bool(shown) and shown[-1].message == serving)
        loads.append(RecipeError(nvme))
        os.kill(os.getpid(), signal.SIGHUP)
        _until("the refusal", lambda: shown[-1].message == refused)
        _until(
            "status.json saying it",
            lambda: json.loads(worker.heartbeat.path.read_text())["message"] == refused,
        )
        on_disk.append(json.loads(worker.heartbeat.path.read_text()))
        os.kill(os.getpid(), signal.SIGHUP)  # the recipe is fixed: a valid one is loaded
        _until("the refusal gone", lambda: shown[-1].message == serving)

    _drive(worker, script)
    assert on_disk[0]["state"] == "running" and on_disk[0]["message"] == refused
    assert on_disk[0]["url"] == "http://172.30.0.1:9000"
    assert not runtime.stops and runtime.made == 0, "the serving engine was never touched"
    first = next(i for i, s in enumerate(shown) if s.message == serving)
    assert all(s.state == "running" for s in shown[first:]), [s.state for s in shown[first:]]
