"""What every engine shares: one container on a bridge network, published on that network's
gateway only, with the recipe's settings and secrets as environment, and one observation of it
all. Engine modules add how their image and prerequisites are made and how readiness is judged.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from supervisor import logs, redaction
from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Container, Image, Mount, RunSpec
from supervisor.engines.base import (
    EXIT_LOG_LINES,
    Endpoint,
    Observed,
    Prerequisite,
    StepContext,
)
from supervisor.errors import Blocked, Permanent
from supervisor.memplan import guard
from supervisor.memplan.fit import Budget
from supervisor.memplan.guard import Guard
from supervisor.memplan.ledger import Ledger
from supervisor.memplan.need import EngineNeed
from supervisor.memplan.preview import preview
from supervisor.memplan.probe import Memory
from supervisor.memplan.settings import MachineSettings
from supervisor.protocol.documents import MemoryPlan, TargetGroup
from supervisor.recipe.schema import RecipeBase, RecipeError

log = logs.get("engine")


@dataclass(frozen=True)
class Network:
    """The bridge network whose gateway gets the engine's port."""

    name: str

    @property
    def description(self) -> str:
        return f"creating the Docker network {self.name}"


@dataclass(frozen=True)
class PulledImage:
    ref: str

    @property
    def description(self) -> str:
        return f"pulling {self.ref}"


@dataclass(frozen=True)
class EngineImage:
    """The image the container runs on: the reference it was resolved from, and its id."""

    ref: str
    image: Image


@dataclass(frozen=True)
class Prerequisites:
    """What is still to be made before the container can run (in order), and the image it
    runs on once that exists."""

    missing: tuple[Prerequisite, ...] = ()
    image: EngineImage | None = None


class ContainerEngine:
    kind = "engine"
    poll_interval = 30.0

    def __init__(
        self,
        name: str,
        recipe: RecipeBase,
        runtime: Runtime,
        state_dir: Path,
        data_dir: Path | None = None,
        *,
        measure: Callable[[MachineSettings], Memory] = guard.measure,
    ) -> None:
        self.name = name
        # the memory plan's claims are shared through the data directory; none: not planned.
        # measure: how the plan measures this engine's memory (a GPU's, through its nvidia-smi)
        ledger = Ledger.for_data_dir(data_dir) if data_dir else None
        self.memory = Guard(name, ledger, runtime, measure) if ledger is not None else None
        self.base_recipe = recipe
        self.runtime = runtime
        self.state_dir = state_dir
        self.container_name = f"lucia-{name}"
        self.stop_grace = recipe.run.stop_grace
        self.ready_timeout = recipe.run.ready_timeout
        self.endpoint: Endpoint | None = None  # known once observed
        with contextlib.suppress(RecipeError):  # mask an adopted engine's output from the start
            redaction.register(recipe.secret_values().values())

    # -- what an engine module provides ---------------------------------------------------------

    def prerequisites(self) -> Prerequisites:
        """What is still to be made, and the image the container must run on."""
        raise NotImplementedError

    def command(self) -> tuple[str, ...]:
        return tuple(self.base_recipe.command)

    def extra_labels(self) -> Mapping[str, str]:
        return {}

    def mounts(self) -> tuple[Mount, ...]:
        return ()

    def targets(self, endpoint: Endpoint) -> tuple[TargetGroup, ...]:
        return (self.target_group(endpoint, {"model": self.base_recipe.model or self.kind}),)

    def notes(self) -> str:
        return ""

    def failed_models(self) -> tuple[str, ...]:
        return ()

    def served_models(self) -> tuple[str, ...]:
        """None, unless the kind names them (each shipped kind does, from its recipe): a kind
        that names none is served by no gateway route, and its worker runs as before."""
        return ()

    def make_own(self, what: Prerequisite, ctx: StepContext) -> None:
        raise ValueError(f"{self.kind} cannot make {what!r}")

    def check_more(self, spec: RunSpec, ctx: StepContext) -> None:
        """The engine's own checks before a start (its argument parser, its memory need)."""

    def memory_need(self) -> EngineNeed | None:
        """What a start needs (its models planned together); None: the start is not planned."""
        return None

    def check_memory(self, replacing: str | None) -> None:
        """Claim the start's memory, or refuse it with the numbers (raises Permanent); last of
        the checks, so a claim is made only for a start that passed the others."""
        if self.memory is None:
            return
        need = self.memory_need()
        if need is not None:
            self.memory.claim(need, replacing)

    def memory_plan(self) -> MemoryPlan | None:
        """The plan of a start now, claiming nothing (status.json's memory); None unplanned."""
        return preview(self.memory, self.planned_need) if self.memory is not None else None

    def planned_need(self, budget: Budget, multiplier: float) -> EngineNeed | None:
        """What a start would need in this budget: what its Check would claim, unless the
        kind plans otherwise before its prerequisites are made (the router's library)."""
        return self.memory_need()

    def planned_memory(self) -> tuple[int, int] | None:
        guard = self.memory
        if guard is None or guard.last is None or guard.limit is None:
            return None
        return guard.last.need.need, guard.limit

    def started(self, container_id: str | None) -> None:
        """After a Start step: the container it made, or None when it failed."""
        if self.memory is not None:
            self.memory.started(container_id)

    def abandoned(self, running: str | None) -> None:
        """The start a passed Check was for will not run: its memory claim moves to the
        container still running (running), or is dropped. A ledger that cannot be written
        keeps the claim pending until the next observation."""
        if self.memory is None:
            return
        try:
            if self.memory.abandon(running):
                log.info("memory claim settled: its start was not run",
                         held_by=running[:12] if running else None)
        except OSError as exc:
            log.warning("memory claim not settled; retrying at the next look", error=str(exc))

    # -- shared ---------------------------------------------------------------------------------

    def observe(self) -> Observed:
        run = self.base_recipe.run
        container = self.runtime.container(self.container_name)
        gateway = self.runtime.gateway(run.network)
        own = self.prerequisites()
        missing = (() if gateway is not None else (Network(run.network),)) + own.missing
        wanted = Endpoint(gateway, run.port) if gateway is not None else None
        # where the engine answers is where its container is published: a replacement on
        # another port that has not happened yet must not move the URL or the file_sd target
        self.endpoint = published(container, gateway) or wanted
        spec = None
        if not missing and wanted is not None and own.image is not None:
            spec = self.run_spec(own.image, wanted)
        return Observed(
            container=container,
            missing=missing,
            spec=spec,
            url=self.endpoint.url if self.endpoint else None,
            targets=self.targets(self.endpoint) if self.endpoint else (),
            notes=self.notes(),
            log=self._log(container),
            version=self.version(container),
            models=self.served_models(),
            memory=self.memory_plan(),
            slots=self.slots(container),
        )

    def version(self, container: Container | None) -> str | None:
        """The version the running engine reports of itself, if it says one."""
        return None

    def slots(self, container: Container | None) -> dict[str, int]:
        """While a container of ours runs: how many requests it holds at once, under the first
        name it serves (its other names are the same model, never counted twice); empty when
        the kind does not say (`parallel`)."""
        if container is None or not container.running or not container.managed:
            return {}
        served, parallel = self.served_models(), self.parallel()
        return {served[0]: parallel} if served and parallel is not None else {}

    def parallel(self) -> int | None:
        """How many requests the engine's launch lets it run at once; None: not known."""
        return None

    def _log(self, container: Container | None) -> tuple[str, ...]:
        """Why an exited container of ours died is in its log, often far above its last line."""
        if container is None or container.running or not container.managed:
            return ()
        return tuple(self.runtime.logs(container.id, tail=EXIT_LOG_LINES))

    def make(self, what: Prerequisite, ctx: StepContext) -> None:
        match what:
            case Network(name):
                self.runtime.create_network(name)
            case PulledImage(ref):
                ctx.progress(what.description)
                self.runtime.pull(ref, ctx.progress, ctx.cancel)
            case _:
                self.make_own(what, ctx)

    def preflight(self, spec: RunSpec, replacing: str | None, ctx: StepContext) -> None:
        """What can be checked before anything is stopped: the image exists, the port is free
        (or held by the container this start replaces), then the engine's own checks. A missing
        image or a taken port is Blocked (tried again: the next look makes the image again, and
        the port may come free)."""
        if self.runtime.image(spec.image) is None:
            raise Blocked(f"the engine image {spec.image[:19]} is missing; it is made again")
        old = self.runtime.container(replacing) if replacing else None
        ours = old is not None and (spec.host_ip, spec.host_port) in old.bindings
        if not ours and not port_free(spec.host_ip, spec.host_port):
            raise Blocked(
                f"port {spec.host_port} on {spec.host_ip} is taken by another program; "
                "free it or change run.port in the recipe"
            )
        self.check_more(spec, ctx)
        self.check_memory(replacing)

    def secrets(self) -> dict[str, str]:
        """Read when used (a rotated token is picked up), registered for masking."""
        try:
            values = self.base_recipe.secret_values()
        except RecipeError as exc:
            raise Permanent(str(exc)) from None
        redaction.register(values.values())
        return values

    def run_spec(self, found: EngineImage, endpoint: Endpoint) -> RunSpec:
        """Everything the container is created with; its fingerprint decides replacement."""
        recipe, run = self.base_recipe, self.base_recipe.run
        return RunSpec(
            name=self.container_name,
            image=found.image.id,
            network=run.network,
            host_ip=endpoint.host,
            host_port=endpoint.port,
            container_port=run.inner_port,
            environment={**recipe.environment, **self.secrets()},
            labels={
                labels.MANAGED: "true",
                labels.NAME: self.name,
                labels.ENGINE: self.kind,
                labels.IMAGE_ID: found.image.id,
                labels.IMAGE_REF: found.ref,
                labels.MODEL: recipe.model,
                **self.extra_labels(),
            },
            command=self.command(),
            gpus=run.gpus,
            shm_size=run.shm_size,
            memory=run.memory,
            ipc_mode=run.ipc,
            ulimits=run.ulimits,
            mounts=(*self.mounts(), *self.volumes()),
        )

    def volumes(self) -> tuple[Mount, ...]:
        """The recipe's run volumes, `${SETTING}` and `~` expanded."""
        recipe = self.base_recipe
        return tuple(
            Mount(str(Path(recipe.expand(v.source)).expanduser()), v.target, v.read_only)
            for v in recipe.run.volumes
        )

    def target_group(self, endpoint: Endpoint, extra: Mapping[str, str]) -> TargetGroup:
        return TargetGroup(
            targets=[f"{endpoint.host}:{endpoint.port}"],
            labels={
                "__metrics_path__": self.base_recipe.run.metrics_path,
                "engine": self.kind,
                "name": self.name,
                **extra,
            },
        )


def published(container: Container | None, gateway: str | None) -> Endpoint | None:
    """Where a running container of ours is published on the gateway; None for anything else."""
    if container is None or not container.running or not container.managed:
        return None
    for host, port in container.bindings:
        if host == gateway and port > 0:
            return Endpoint(host, port)
    return None


def port_free(host: str, port: int) -> bool:
    """Is host:port free for docker's port publishing? Only "in use" says no: a privileged
    port (dockerd binds as root) or an address this process cannot see is left to docker."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True
