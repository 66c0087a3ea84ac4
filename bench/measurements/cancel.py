"""7. Cancel: request stopped during a build -> status stopped, and no build container left.

Baseline: docker kill.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import docker.errors

from ..lab import RUN_ID, Lab
from ..report import Row, num, overhead, summary, verdict
from ..status import Timeout, answers
from .common import MS, Plan, Shared


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
