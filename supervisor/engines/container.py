"""What every engine shares: one container on a bridge network, published on that network's
gateway only, with the recipe's settings and secrets as environment, and one observation of it
all. Engine modules add how their image and prerequisites are made and how readiness is judged.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Generic, TypeVar

from supervisor import logs, redaction
from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Container, Mount, RunSpec
from supervisor.engines.base import (
    EXIT_LOG_LINES,
    Claimant,
    Endpoint,
    EngineInfo,
    Observed,
    Prerequisite,
    StepContext,
)
from supervisor.engines.look import EngineImage, Look, Network, P, PulledImage
from supervisor.errors import Blocked, Permanent
from supervisor.memplan import guard
from supervisor.memplan.fit import Budget
from supervisor.memplan.guard import Guard
from supervisor.memplan.ledger import Ledger
from supervisor.memplan.need import EngineNeed
from supervisor.memplan.preview import preview
from supervisor.memplan.probe import Memory
from supervisor.memplan.settings import MachineSettings
from supervisor.protocol.documents import Capability, MemoryPlan, TargetGroup, capabilities
from supervisor.recipe.schema import RecipeBase, RecipeError

log = logs.get("engine")


R = TypeVar("R", bound=RecipeBase)


class ContainerEngine(Generic[R, P]):
    """The shared engine over its recipe type R; P is what its kind's look adds."""

    kind = "engine"
    poll_interval = 30.0

    def __init__(
        self,
        name: str,
        recipe: R,
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
        self.guard = Guard(name, ledger, runtime, measure) if ledger is not None else None
        self.recipe = recipe
        self.runtime = runtime
        self.state_dir = state_dir
        self.data_dir = data_dir
        self.container_name = f"lucia-{name}"
        self.last: Look[P] | None = None  # the last look, set by observe only
        with contextlib.suppress(RecipeError):  # mask an adopted engine's output from the start
            redaction.register(recipe.secret_values().values())

    @property
    def endpoint(self) -> Endpoint | None:
        """Where the engine answers, as the last look found it; None before one."""
        return self.last.endpoint if self.last is not None else None

    @functools.cached_property
    def info(self) -> EngineInfo:
        """What the worker knows of this engine without a look (made once, on first use)."""
        run = self.recipe.run
        claim = Claimant(self.guard, self.memory_need) if self.guard is not None else None
        return EngineInfo(
            kind=self.kind,
            container_name=self.container_name,
            stop_grace=run.stop_grace,
            ready_timeout=run.ready_timeout,
            poll_interval=self.poll_interval,
            private_files=self.private_files(),
            models=self.named(),
            claim=claim,
        )

    # -- what an engine module provides ---------------------------------------------------------

    def prerequisites(self) -> P:
        """What is still to be made, the image the container must run on, and whatever else
        the kind's look reads before its endpoint is known."""
        raise NotImplementedError

    def seen(self, look: Look[P]) -> Look[P]:
        """The look with what the kind reads of its running engine (its own endpoints)."""
        return look

    def command(self) -> tuple[str, ...]:
        return tuple(self.recipe.command)

    def extra_labels(self) -> Mapping[str, str]:
        return {}

    def mounts(self) -> tuple[Mount, ...]:
        return ()

    def private_files(self) -> tuple[Path, ...]:
        """Files only this engine's worker writes (their stale temp files are cleaned)."""
        return ()

    def named(self) -> tuple[str, ...]:
        """The names it serves before any look: none, unless the kind names them (each shipped
        kind does, from its recipe): a kind that names none is served by no gateway route, and
        its worker runs as before."""
        return ()

    def make_own(self, what: Prerequisite, ctx: StepContext) -> None:
        raise ValueError(f"{self.kind} cannot make {what!r}")

    def check_more(self, spec: RunSpec, ctx: StepContext) -> None:
        """The engine's own checks before a start (its argument parser, its memory need)."""

    def settle(self, running: str | None, started: bool) -> None:
        """After a start's memory claim is settled: the kind's own effects of the outcome."""

    def memory_need(self) -> EngineNeed | None:
        """What a start needs (its models planned together); None: the start is not planned."""
        return None

    def planned_need(self, own: P, budget: Budget, multiplier: float) -> EngineNeed | None:
        """What a start would need in this budget: what its Check would claim, unless the
        kind plans otherwise before its prerequisites are made (the router's library)."""
        return self.memory_need()

    def parallel(self) -> int | None:
        """How many requests the engine's launch lets it run at once; None: not known."""
        return None

    # -- the answers: pure functions of one look ------------------------------------------------

    def targets(self, look: Look[P]) -> tuple[TargetGroup, ...]:
        """The file_sd target groups while it serves."""
        if look.endpoint is None:
            return ()
        return (self.target_group(look.endpoint, {"model": self.recipe.model or self.kind}),)

    def notes(self, look: Look[P]) -> str:
        return ""

    def served(self, look: Look[P]) -> tuple[str, ...]:
        """The model names a client asks this engine for, in every state, from the recipe or
        what the worker made of it (never from the running engine): status.json's models."""
        return self.named()

    def failed(self, look: Look[P]) -> tuple[str, ...]:
        """The models whose load failed, as this look saw (the worker's gauge)."""
        return ()

    def version(self, look: Look[P]) -> str | None:
        """The version the running engine reports of itself, if it says one."""
        return None

    def slots(self, look: Look[P]) -> dict[str, int]:
        """While a container of ours runs: how many requests it holds at once, under the first
        name it serves (its other names are the same model, never counted twice); empty when
        the kind does not say (`parallel`)."""
        if not look.running:
            return {}
        served, parallel = self.served(look), self.parallel()
        return {served[0]: parallel} if served and parallel is not None else {}

    def capabilities(self, look: Look[P]) -> dict[str, tuple[Capability, ...]]:
        """What each name it serves serves, in every state (status.json's capabilities): the
        recipe's `capabilities` for every name when it says, else the kind's own rule; a name
        left out is not known (the gateway forwards its requests as before)."""
        declared = self.recipe.capabilities
        if declared is not None:
            return {name: capabilities(declared) for name in self.served(look)}
        return self.serves(look)

    def serves(self, look: Look[P]) -> dict[str, tuple[Capability, ...]]:
        """The kind's own rule of what each name serves: none known, unless the kind says."""
        return {}

    def answers(self, look: Look[P]) -> Observed:
        """What the worker is given of one look: a pure function of it."""
        return Observed(
            container=look.container,
            missing=look.missing,
            spec=look.spec,
            url=look.endpoint.url if look.endpoint else None,
            targets=self.targets(look),
            notes=self.notes(look),
            log=look.log,
            version=self.version(look),
            models=self.served(look),
            failed=self.failed(look),
            memory_plan=look.memory_plan,
            slots=self.slots(look),
            capabilities=self.capabilities(look),
        )

    # -- shared ---------------------------------------------------------------------------------

    def observe(self) -> Observed:
        """One look, kept as the last one (the steps after it read it), and its answers."""
        look = self.look()
        self.last = look
        return self.answers(look)

    def look(self) -> Look[P]:
        """Everything one observation reads, into one value; it keeps nothing itself."""
        run = self.recipe.run
        container = self.runtime.container(self.container_name)
        gateway = self.runtime.gateway(run.network)
        own = self.prerequisites()
        missing = (() if gateway is not None else (Network(run.network),)) + own.missing
        wanted = Endpoint(gateway, run.port) if gateway is not None else None
        spec = None
        if not missing and wanted is not None and own.image is not None:
            spec = self.run_spec(own.image, wanted)
        look = Look(
            container=container,
            # where the engine answers is where its container is published: a replacement on
            # another port that has not happened yet must not move the URL or the file_sd target
            endpoint=published(container, gateway) or wanted,
            missing=missing,
            spec=spec,
            own=own,
            log=self._log(container),
            memory_plan=self.memory_plan(own),
        )
        return self.seen(look)

    def memory_plan(self, own: P) -> MemoryPlan | None:
        """The plan of a start now, claiming nothing (status.json's memory); None unplanned."""
        if self.guard is None:
            return None
        return preview(self.guard, functools.partial(self.planned_need, own))

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

    def secrets(self) -> dict[str, str]:
        """Read when used (a rotated token is picked up), registered for masking."""
        try:
            values = self.recipe.secret_values()
        except RecipeError as exc:
            raise Permanent(str(exc)) from None
        redaction.register(values.values())
        return values

    def run_spec(self, found: EngineImage, endpoint: Endpoint) -> RunSpec:
        """Everything the container is created with; its fingerprint decides replacement."""
        recipe, run = self.recipe, self.recipe.run
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
                # install.sh --purge finds this installation's containers by it
                **({labels.DATA: str(self.data_dir)} if self.data_dir is not None else {}),
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
        recipe = self.recipe
        return tuple(
            Mount(str(Path(recipe.expand(v.source)).expanduser()), v.target, v.read_only)
            for v in recipe.run.volumes
        )

    def target_group(self, endpoint: Endpoint, extra: Mapping[str, str]) -> TargetGroup:
        return TargetGroup(
            targets=[f"{endpoint.host}:{endpoint.port}"],
            labels={
                "__metrics_path__": self.recipe.run.metrics_path,
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
