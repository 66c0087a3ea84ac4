"""The bench's world: run id, base image, recipe repository, network, engines and their cleanup.

The engines themselves are in engine.py.

Everything made here carries the run id in its name and the label lucia.bench.run=<run id>: the
base image has the label from its first instruction, so every image built FROM it (recipe image,
grammar image, the intermediate images of a cancelled build) and every container run from those
inherits it. Lab.cleanup() removes all of it and is safe after a failure half-way or a Ctrl-C.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import docker
import docker.errors

from tests.standin import busybox_image, recipe_repository

from .engine import ROOT, Engine, kill_group
from .status import answers

RUN_ID = uuid.uuid4().hex[:8]
LABEL = "lucia.bench.run"
ROLE = "lucia.bench.role"


def adopt_run(run_id: str) -> None:
    """Make this process clean up after an earlier run that was killed (SIGKILL, a crash)."""
    global RUN_ID  # noqa: PLW0603 - the run id names everything; --clean swaps it once
    if not run_id.isalnum():
        raise ValueError(f"not a run id: {run_id!r}")
    RUN_ID = run_id


class Lab:
    def __init__(self) -> None:
        self.client = docker.from_env(timeout=120)
        self.client.ping()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"lucia-bench-{RUN_ID}-"))
        self.network = f"lucia-bench-{RUN_ID}"
        self.shared_tag = f"lucia-bench-{RUN_ID}-recipe:v1"
        self.engines: list[Engine] = []
        self.procs: list[subprocess.Popen[Any]] = []
        self._ports: set[int] = set()
        self._base: str | None = None
        self._repo: tuple[Path, str] | None = None
        self._gateway: str | None = None
        self._main: Engine | None = None
        self._slow: Engine | None = None
        self.slow_building = False
        self._cleaned = False

    # -- docker things -------------------------------------------------------------------------

    def labels(self, role: str) -> dict[str, str]:
        return {LABEL: RUN_ID, ROLE: role}

    def base_image(self) -> str:
        """FROM scratch with Debian's static busybox, labelled from the first instruction on."""
        if self._base is None:
            tag = f"lucia-bench-{RUN_ID}-busybox:1"
            self._base = busybox_image(self.client, self.tmp / "base", tag, {LABEL: RUN_ID})
        return self._base

    def repo(self) -> tuple[Path, str]:
        """A git copy of demo/recipe-repo; its path and commit."""
        if self._repo is None:
            path = self.tmp / "recipe-repo"
            self._repo = (path, recipe_repository(path, message="recipe 0.7.0 (bench)"))
        return self._repo

    def gateway(self) -> str:
        """The bench's bridge network (made here, labelled), and its gateway address."""
        if self._gateway is None:
            try:
                network = self.client.networks.get(self.network)
            except docker.errors.NotFound:
                network = self.client.networks.create(
                    self.network,
                    driver="bridge",
                    labels={**self.labels("network"), "lucia.managed": "true"},
                )
            network.reload()
            self._gateway = str(network.attrs["IPAM"]["Config"][0]["Gateway"])
        return self._gateway

    def free_port(self) -> int:
        while True:
            with socket.socket() as sock:
                sock.bind(("", 0))
                port = int(sock.getsockname()[1])
            if port not in self._ports:
                self._ports.add(port)
                return port

    # -- engines -------------------------------------------------------------------------------

    def engine(self, role: str, image_tag: str | None = None, **kwargs: Any) -> Engine:
        name = f"b{RUN_ID}-{role}"
        root = self.tmp / name
        root.mkdir()
        self.gateway()
        engine = Engine(self, name, root, self.free_port(), image_tag or self.shared_tag, **kwargs)
        self.engines.append(engine)
        return engine

    def main(self) -> Engine:
        """The shared engine, running: builds the shared recipe and grammar images once."""
        if self._main is None:
            engine = self.engine("main")
            engine.start_worker()
            generation = engine.request("running")
            engine.wait(answers(generation, "running", "failed"), 600, "first start")
            self._main = engine
        engine = self._main
        status = engine.status() or {}
        if status.get("state") != "running":
            generation = engine.request("running")
            status = engine.wait(answers(generation, "running", "failed"), 120, "running")
        if status.get("state") != "running":
            raise RuntimeError(f"the main engine failed: {status.get('message')}")
        return engine

    def slow(self, seconds: int) -> Engine:
        """An engine whose recipe image build takes `seconds` (ARG SLOW), on its own image tag."""
        if self._slow is None:
            self.base_image()
            self._slow = self.engine(
                "slow",
                image_tag=f"lucia-bench-{RUN_ID}-slow:v1",
                build_args={"SLOW": str(seconds)},
            )
            self._slow.start_worker()
        return self._slow

    def build_containers(self, running_only: bool = True) -> list[str]:
        """Ids of this run's build-step containers (the ARG SLOW loop of the recipe image)."""
        found = self.client.api.containers(
            all=not running_only, filters={"label": f"{LABEL}={RUN_ID}"}
        )
        return [c["Id"] for c in found if "compiling kernels" in str(c.get("Command", ""))]

    def spawn(self, command: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc: subprocess.Popen[Any] = subprocess.Popen(
            command, cwd=ROOT, start_new_session=True, **kwargs
        )
        self.procs.append(proc)
        return proc

    # -- cleanup -------------------------------------------------------------------------------

    def cleanup(self) -> list[str]:
        """Remove everything this run made; what could not be removed, as lines."""
        if self._cleaned:
            return []
        self._cleaned = True
        problems: list[str] = []
        procs = [e.proc for e in self.engines if e.proc is not None] + self.procs
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                kill_group(proc)
        for step in (self._remove_containers, self._remove_networks, self._remove_images):
            try:
                step()
            except docker.errors.DockerException as exc:
                problems.append(f"{step.__name__}: {exc}")
        for tmp in Path(tempfile.gettempdir()).glob(f"lucia-bench-{RUN_ID}-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        if self.tmp.exists():
            problems.append(f"{self.tmp} could not be removed")
        with contextlib.suppress(docker.errors.DockerException):
            problems.extend(f"left behind: {thing}" for thing in self._leftovers())
        self.client.close()
        return problems

    def _ours(self) -> list[dict[str, Any]]:
        api = self.client.api
        found = {
            c["Id"]: c for c in api.containers(all=True, filters={"label": f"{LABEL}={RUN_ID}"})
        }
        for prefix in (f"lucia-b{RUN_ID}", f"lucia-bench-{RUN_ID}"):
            for c in api.containers(all=True, filters={"name": prefix}):
                found[c["Id"]] = c
        return list(found.values())

    def _remove_containers(self) -> None:
        for _ in range(3):  # a cancelled build's step container can appear a moment late
            for container in self._ours():
                with contextlib.suppress(docker.errors.NotFound):
                    self.client.api.remove_container(container["Id"], force=True)
            if not self._ours():
                return
            time.sleep(1)

    def _remove_networks(self) -> None:
        for network in self.client.api.networks(names=[self.network]):
            if network["Name"] == self.network:
                with contextlib.suppress(docker.errors.NotFound):
                    self.client.api.remove_network(network["Id"])

    def _remove_images(self) -> None:
        """Leaves first: an image with children cannot be removed, even by force."""
        api = self.client.api
        for _ in range(20):
            images = api.images(all=True, filters={"label": f"{LABEL}={RUN_ID}"})
            if not images:
                return
            parents = {(api.inspect_image(i["Id"]).get("Parent") or "") for i in images}
            leaves = [i for i in images if i["Id"] not in parents] or images
            for image in leaves:
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    api.remove_image(image["Id"], force=True)

    def _leftovers(self) -> list[str]:
        api = self.client.api
        left = [f"container {c['Names'][0]}" for c in self._ours()]
        left += [
            f"image {i['Id'][:19]}"
            for i in api.images(all=True, filters={"label": f"{LABEL}={RUN_ID}"})
        ]
        left += [
            f"network {n['Name']}"
            for n in api.networks(names=[self.network])
            if n["Name"] == self.network
        ]
        return left
