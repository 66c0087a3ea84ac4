"""llama.cpp's llama-server in router mode: one router container serving the cached models.

The models are those of the library's GGUF cache (one child process per loaded model);
readiness and targets come from its /models.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from supervisor import logs
from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Container, Mount
from supervisor.engines.base import Observed, Prerequisite, StepContext
from supervisor.engines.container import ContainerEngine
from supervisor.engines.llama_router import api as router_api
from supervisor.engines.llama_router import memory as router_memory
from supervisor.engines.llama_router import plan as router_plan
from supervisor.engines.llama_router import preset, serves, startup
from supervisor.engines.llama_router.library_sync import (
    LibrarySync,
    Synced,
    Syncer,
    library_fingerprint,
)
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.engines.llama_router.startup import StartupModels
from supervisor.engines.look import EngineImage, Look, Prerequisites, PulledImage
from supervisor.errors import Permanent, Transient
from supervisor.library import models as library
from supervisor.memplan.fit import Budget
from supervisor.memplan.need import EngineNeed
from supervisor.protocol.documents import Capability, TargetGroup

log = logs.get("llama-router")


@dataclass(frozen=True)
class RouterLook(Prerequisites):
    """What one look at the router adds: the library as found, the names it serves, whether
    the last sync is current with it, that sync's record, and while a router of ours runs its
    /models, the build and the loaded models' slots its /props state."""

    found: library.Library | None = None
    named: tuple[str, ...] = ()
    current: bool = False
    synced: Synced | None = None
    listing: tuple[router_api.ModelState, ...] | None = None  # None: none runs, or no answer
    build: str | None = None
    slots: Mapping[str, int] = field(default_factory=dict)


class Props:
    """The router's `GET /props` answers, each read once: the build per container, a loaded
    model's slots per child (the same container, model and command line)."""

    def __init__(self) -> None:
        self._build: dict[str, str] = {}
        self._slots: dict[tuple[str, str, tuple[str, ...]], int] = {}

    def build(self, container: str, get: Callable[[str], Any]) -> str | None:
        """The build the router states, read once per container: until it answers, each look
        asks again."""
        if container in self._build:
            return self._build[container]
        try:
            found = router_api.build(get("/props"))
        except (OSError, ValueError):
            return None
        if found is not None:
            self._build.clear()
            self._build[container] = found
        return found

    def slots(
        self,
        container: str,
        listing: tuple[router_api.ModelState, ...],
        environment: Mapping[str, str],
        get: Callable[[str], Any],
    ) -> dict[str, int]:
        """Each loaded model's slots (api.slots), from its `GET /props?model=NAME&autoload=
        false` (never a load). A model whose /props does not answer is left out, and asked
        again at the next look; one that is not loaded has none."""
        found: dict[str, int] = {}
        known: dict[tuple[str, str, tuple[str, ...]], int] = {}
        for model in listing:
            if model.value != router_api.LOADED:
                continue
            key = (container, model.name, model.args)
            count = self._slots.get(key)
            if count is None:
                try:
                    props = get(router_api.props_path(model.name))
                except (OSError, ValueError):
                    continue
                count = router_api.slots(props, model.args, environment)
            if count is not None:
                found[model.name] = known[key] = count
        self._slots.clear()
        self._slots.update(known)
        return found

    def forget(self) -> None:
        """No router of ours runs: the slots read of the last one are gone."""
        self._slots.clear()


class LlamaRouter(ContainerEngine[LlamaRouterRecipe, RouterLook]):
    kind = "llama-router"

    def __init__(
        self,
        name: str,
        recipe: LlamaRouterRecipe,
        runtime: Runtime,
        state_dir: Path,
        data_dir: Path | None = None,
    ) -> None:
        super().__init__(name, recipe, runtime, state_dir, data_dir)
        self.poll_interval = recipe.library.poll_seconds
        self.syncer = Syncer(name, recipe, self.guard, state_dir)
        self.cache_dir = self.syncer.cache_dir
        self.preset_path = self.syncer.preset_path
        self._applied = startup.Applied(state_dir / "startup.json")
        self._headers = router_memory.Headers()
        self._props = Props()

    # -- observe -------------------------------------------------------------------------------

    def observe(self) -> Observed:
        """The shared observation, with one poll of the router's /models (its targets and
        note), and a new load-on-startup set to apply to the router that runs."""
        observed = super().observe()
        look = self.last
        if look is None or look.container is None or not look.running:
            return observed
        container = look.container
        applied, reloaded = self._applied_set(container)
        listing = look.own.listing
        if listing is None or observed.missing or observed.spec is None:
            return observed
        if (container.image_id, container.labels.get(labels.FINGERPRINT)) != (
            observed.spec.image,
            observed.spec.fingerprint(),
        ):
            return observed  # it is to be replaced: the new container starts with the preset
        wanted = self._wanted()
        if set(applied) == set(wanted) and not set(reloaded) & set(wanted):
            return observed
        load, unload = router_api.changes(listing, wanted, applied, reloaded)
        return replace(observed, missing=(StartupModels(container.id, wanted, load, unload),))

    def _wanted(self) -> tuple[str, ...]:
        synced = self.syncer.synced()
        if synced is None:
            return ()
        if synced.startup is not None:
            return synced.startup
        return startup.startup_models(self.recipe, synced.names)

    def _applied_set(self, container: Container) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The load-on-startup set this container has, and the models whose sections it has
        reloaded since (and so unloaded). First seen (just started, or adopted without a
        record), it is the preset's: only a sync step changes the preset, and an observation
        follows every step."""
        found = self._applied.read()
        if found is not None and found[0] == container.id:
            return found[1], found[2]
        wanted = self._wanted()
        self._applied.record(container.id, wanted)
        return wanted, ()

    def prerequisites(self) -> RouterLook:
        found = library.scan(self.recipe.library.models_path)
        seen = self.syncer.look(found)
        ref = self.recipe.router.image
        image = self.runtime.image(ref)
        missing = (() if image is not None else (PulledImage(ref),)) + (
            () if seen.current else (LibrarySync(),)
        )
        made = EngineImage(ref, image) if image is not None else None
        return RouterLook(missing, made, found, seen.names, seen.current, self.syncer.synced())

    def seen(self, look: Look[RouterLook]) -> Look[RouterLook]:
        """While a router of ours runs: its /models (this look's targets, note and failures),
        its build, and its loaded models' slots."""
        if not look.running or look.container is None or look.endpoint is None:
            self._props.forget()
            return look
        url = look.endpoint.url

        def get(path: str) -> Any:
            return router_api.get(url, path)

        listing = self._listing(url)
        build = self._props.build(look.container.id, get)
        slots = self._props.slots(look.container.id, listing or (), self.recipe.environment, get)
        return replace(look, own=replace(look.own, listing=listing, build=build, slots=slots))

    # -- make ----------------------------------------------------------------------------------

    def make_own(self, what: Prerequisite, ctx: StepContext) -> None:
        if isinstance(what, LibrarySync):
            changed = self.syncer.sync(ctx)
            if changed is not None:
                self._reload(changed)
        elif isinstance(what, StartupModels):
            startup.apply(
                what,
                ctx,
                url=self._url,
                models=self._models,
                ready_timeout=self.info.ready_timeout,
                applied=self._applied,
            )
        else:
            super().make_own(what, ctx)

    def _reload(self, changed: tuple[str, ...]) -> None:
        """Ask a running router to re-read its preset; nothing to do when none answers. It
        unloads the models whose sections changed: those of the load-on-startup set are due
        again (the next observation loads them)."""
        with contextlib.suppress(OSError, ValueError, Transient, Permanent):
            self._get("/models?reload=1")
            log.info("router asked to reload its preset", changed=",".join(changed))
            found = self._applied.read()
            if found is not None:
                self._applied.record(found[0], found[1], tuple(sorted({*found[2], *changed})))

    # -- run -----------------------------------------------------------------------------------

    def command(self) -> tuple[str, ...]:
        container_dir = self.recipe.library.container_dir
        return (
            "--models-preset",
            f"{container_dir.rstrip('/')}/{preset.PRESET_NAME}",
            "--models-max",
            str(self.recipe.router.models_max),
            "--host",
            "0.0.0.0",  # noqa: S104 - inside the container; published on the gateway
            "--port",
            str(self.recipe.run.inner_port),  # always explicit: the default is changing upstream
            "--metrics",
            *self.recipe.router.args,
        )

    def mounts(self) -> tuple[Mount, ...]:
        return (Mount(str(self.cache_dir), self.recipe.library.container_dir, read_only=True),)

    def _url(self) -> str:
        if self.endpoint is None:
            raise OSError("the router's network has not been seen yet")
        return self.endpoint.url

    def _get(self, path: str) -> Any:
        return router_api.get(self._url(), path)

    def _models(self) -> tuple[router_api.ModelState, ...] | None:
        """What /models says now; None while the router does not answer."""
        try:
            return self._listing(self._url())
        except OSError:
            return None

    @staticmethod
    def _listing(url: str) -> tuple[router_api.ModelState, ...] | None:
        try:
            return router_api.parse(router_api.get(url, "/models"))
        except (OSError, ValueError):
            return None

    def ready(self) -> bool:
        """Router mode answers /health before any model loads: ready means every
        load-on-startup model reports loaded in /models. A model that failed fails the start."""
        models = self._models()
        if models is None:
            return False
        wanted = set(self._wanted())
        for model in router_api.failed(models):
            if model.name in wanted:
                code = model.exit_code if model.exit_code is not None else "unknown"
                raise Permanent(f"model {model.name} failed to load (exit code {code})")
        loaded = {model.name for model in models if model.value == router_api.LOADED}
        return wanted <= loaded

    def version(self, look: Look[RouterLook]) -> str | None:
        """The llama-server build the running router states in `GET /props` (`build_info`)."""
        return look.own.build if look.running else None

    def slots(self, look: Look[RouterLook]) -> dict[str, int]:
        """Each loaded model's slots, as this look read them (Props)."""
        return dict(look.own.slots) if look.running else {}

    def targets(self, look: Look[RouterLook]) -> tuple[TargetGroup, ...]:
        """One target per loaded model, from this look's poll of /models."""
        endpoint = look.endpoint
        if endpoint is None or not look.running:
            return ()
        address = f"{endpoint.host}:{endpoint.port}"
        common = {
            "__metrics_path__": self.recipe.run.metrics_path,
            "engine": self.kind,
            "name": self.name,
        }
        return router_api.target_groups(look.own.listing or (), address, common)

    def notes(self, look: Look[RouterLook]) -> str:
        synced, listing = look.own.synced, look.own.listing
        parts = [router_api.note(listing)] if listing is not None else []
        if synced and synced.skipped:
            parts.append(f"skipped {synced.skipped}")
        if synced and synced.unfit:
            parts.append(f"not offered (cannot fit even alone): {synced.unfit}")
        return "; ".join(parts)

    def memory_need(self) -> EngineNeed | None:
        synced = self.syncer.synced()
        return router_memory.need(self.name, synced.startup_need) if synced is not None else None

    def planned_need(self, own: RouterLook, budget: Budget, multiplier: float) -> EngineNeed | None:
        """While the last sync is current, what its Check claims; before a sync is (a router
        that never ran, a model Ready since), what that sync would plan from the library's
        GGUF headers: a start that cannot fit is said before it is asked for."""
        found = own.found
        if own.current or found is None:
            return self.memory_need()
        read = self._headers.models(library_fingerprint(found), router_plan.units(found))
        return router_memory.library_need(self.name, self.recipe, read, budget, multiplier)

    def served(self, look: Look[RouterLook]) -> tuple[str, ...]:
        """What this look at the library named: the preset's models while the last sync is
        current with it, else those the next sync would offer, so a router that never ran names
        its models and a model Ready since is named at this look."""
        return look.own.named

    def named(self) -> tuple[str, ...]:
        """Before any look, the preset's (the library may be a slow share)."""
        return preset.models(self.syncer.preset_text())

    def serves(self, look: Look[RouterLook]) -> dict[str, tuple[Capability, ...]]:
        """Each named model's (serves.py): from the arguments its child runs with while the
        router runs it (its /models `args`), else those its preset gives it, and the pooling
        its GGUF declares as the last sync read it; a model no sync has read is not known."""
        synced = look.own.synced
        if synced is None:
            return {}
        listing = look.own.listing if look.running else None
        running = {model.name: model.args for model in listing or () if model.args}
        router, found = self.recipe.router, {}
        for name in look.own.named:
            declared = synced.pooling.get(name)
            if declared is None:
                continue
            args = running.get(name) or (
                *router.args,
                *serves.preset_args(router.defaults, serves.pooled(declared)),
            )
            found[name] = serves.serves(args, self.recipe.environment, declared)
        return found

    def failed(self, look: Look[RouterLook]) -> tuple[str, ...]:
        """The models of this look whose load failed (the worker's gauge)."""
        return tuple(model.name for model in router_api.failed(look.own.listing or ()))

    def private_files(self) -> tuple[Path, ...]:
        return (self.syncer.stamp, self.preset_path, self._applied.path)
