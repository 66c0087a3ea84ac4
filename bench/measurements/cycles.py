"""2 and 3. The interleaved stop/start cycles whose figures the ready and stop rows report.

Each cycle: the worker stops and starts the main engine, then docker runs and stops the same
image (the baselines).
"""

from __future__ import annotations

import contextlib
import time
import urllib.error
import urllib.request
from typing import Any

import docker.errors

from ..engine import Engine
from ..lab import RUN_ID, Lab
from ..status import StatusWatch, Timeout, answers
from .common import MS, Cycles, Plan, Shared


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


def measure_cycles(lab: Lab, plan: Plan, shared: Shared) -> Cycles:
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
