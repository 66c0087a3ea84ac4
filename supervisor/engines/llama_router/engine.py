"""llama.cpp's llama-server in router mode: the model library, a local GGUF cache, a preset, and
one router container serving the models (one child process per loaded model)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from supervisor import logs
from supervisor.docker import labels
from supervisor.docker.runtime import Runtime
from supervisor.docker.spec import Container, Mount
from supervisor.engines.base import Endpoint, Observed, Prerequisite, StepContext
from supervisor.engines.container import ContainerEngine, EngineImage, Prerequisites, PulledImage
from supervisor.engines.llama_router import api as router_api
from supervisor.engines.llama_router import memory as router_memory
from supervisor.engines.llama_router import preset
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.errors import Cancelled, Permanent, Transient
from supervisor.library import cache as gguf_cache
from supervisor.library import models as library
from supervisor.memplan import settings
from supervisor.memplan.need import EngineNeed, ModelNeed
from supervisor.protocol import files
from supervisor.protocol.documents import TargetGroup

_LOAD_POLL: Final = 0.25
log = logs.get("llama-router")


@dataclass(frozen=True)
class Synced:
    """What the last sync made: the library it saw, the models it cached, the preset it wrote."""

    library: str
    models: tuple[tuple[str, str, str | None], ...]  # (name, model file, mmproj file)
    preset: str
    skipped: str = ""  # the files refused, named for the status message
    startup: tuple[str, ...] | None = None  # the preset's load-on-startup models
    startup_need: tuple[ModelNeed, ...] = ()  # the memory plan's start: what the Check claims
    unfit: str = ""  # models not offered: they cannot fit even alone

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.models)


@dataclass(frozen=True)
class StartupModels:
    """A running router given a new load-on-startup set through its API, not a restart: the
    models new to the set are loaded, those dropped from it unloaded; the rest serve on."""

    container_id: str
    wanted: tuple[str, ...]
    load: tuple[str, ...] = ()
    unload: tuple[str, ...] = ()

    @property
    def description(self) -> str:
        doing = [f"loading {', '.join(self.load)}"] if self.load else []
        doing += [f"unloading {', '.join(self.unload)}"] if self.unload else []
        return "applying the load-on-startup set" + (f": {'; '.join(doing)}" if doing else "")


@dataclass(frozen=True)
class LibrarySync:
    """The GGUF cache and the preset, current with the library and the recipe."""

    @property
    def description(self) -> str:
        return "syncing the model library"


@dataclass(frozen=True)
class _Section:
    name: str
    model_file: str
    mmproj_file: str | None


def library_fingerprint(found: library.Library) -> str:
    """Changes when a model becomes Ready or stops being Ready, or one of its files changes."""
    digest = hashlib.sha256()
    for model in found.models:
        digest.update(model.guid.encode())
        for path in model.files:
            with contextlib.suppress(OSError):
                info = path.stat()
                digest.update(f"{path}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def _settled(model: router_api.ModelState | None) -> bool:
    """A load has ended: loaded, failed, or the model is no longer offered."""
    return model is None or model.value == router_api.LOADED or (
        model.failed and model.value != router_api.LOADING
    )


def startup_models(recipe: LlamaRouterRecipe, cached: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(name for name in recipe.router.load_on_startup if name in cached)


class LlamaRouter(ContainerEngine):
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
        self.recipe = recipe
        self.poll_interval = recipe.library.poll_seconds
        self.cache_dir = recipe.library.cache_path
        self.preset_path = self.cache_dir / preset.PRESET_NAME
        self._stamp = state_dir / "synced.json"
        self._applied = state_dir / "startup.json"  # the load-on-startup set a container has
        self._listing: tuple[router_api.ModelState, ...] | None = None  # this observation's

    # -- observe -------------------------------------------------------------------------------

    def observe(self) -> Observed:
        """The shared observation, with one poll of the router's /models (its targets and
        note), and a new load-on-startup set to apply to the router that runs."""
        self._listing = None
        observed = super().observe()
        container = observed.container
        if container is None or not container.running or not container.managed:
            self._listing = None
            return replace(observed, targets=(), notes=self.notes())
        applied, reloaded = self._applied_set(container)
        if self._listing is None or observed.missing or observed.spec is None:
            return observed
        if (container.image_id, container.labels.get(labels.FINGERPRINT)) != (
            observed.spec.image,
            observed.spec.fingerprint(),
        ):
            return observed  # it is to be replaced: the new container starts with the preset
        wanted = self._wanted()
        if set(applied) == set(wanted) and not set(reloaded) & set(wanted):
            return observed
        load, unload = router_api.changes(self._listing, wanted, applied, reloaded)
        return replace(observed, missing=(StartupModels(container.id, wanted, load, unload),))

    def _wanted(self) -> tuple[str, ...]:
        synced = self._synced()
        if synced is None:
            return ()
        if synced.startup is not None:
            return synced.startup
        return startup_models(self.recipe, synced.names)

    def _applied_set(self, container: Container) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The load-on-startup set this container has, and the models whose sections it has
        reloaded since (and so unloaded). First seen (just started, or adopted without a
        record), it is the preset's: only a sync step changes the preset, and an observation
        follows every step."""
        found = self._read_record()
        if found is not None and found[0] == container.id:
            return found[1], found[2]
        wanted = self._wanted()
        self._record(container.id, wanted)
        return wanted, ()

    def _read_record(self) -> tuple[str, tuple[str, ...], tuple[str, ...]] | None:
        try:
            data = json.loads(files.read_text(self._applied, limit=1024 * 1024))
            models = tuple(str(name) for name in data["models"])
            reloaded = tuple(str(name) for name in data.get("reloaded", []))
            return str(data["container"]), models, reloaded
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _record(
        self, container_id: str, models: tuple[str, ...], reloaded: tuple[str, ...] = ()
    ) -> None:
        document = {"container": container_id, "models": list(models), "reloaded": reloaded}
        files.write_atomic(self._applied, json.dumps(document).encode(), 0o600)

    def prerequisites(self) -> Prerequisites:
        found = library.scan(self.recipe.library.models_path)
        synced = self._synced()
        current = (
            synced is not None
            and synced.library == self._sync_key(found)
            and self._preset_text() == synced.preset
        )
        ref = self.recipe.router.image
        image = self.runtime.image(ref)
        missing = (() if image is not None else (PulledImage(ref),)) + (
            () if current else (LibrarySync(),)
        )
        return Prerequisites(missing, EngineImage(ref, image) if image is not None else None)

    def _sync_key(self, found: library.Library) -> str:
        """The library as seen, the recipe's part of the preset and the machine settings the
        memory plan divides: a change in any means a new sync (which copies only what changed)
        and a new preset (its contexts and offered models planned again)."""
        router, where = self.recipe.router, self.recipe.library
        recipe_part = json.dumps(
            [
                router.load_on_startup,
                router.defaults,
                router.models_max,
                where.container_dir,
                str(where.cache_path),
                self._machine_key(),
            ],
            sort_keys=True,
            default=str,
        )
        return library_fingerprint(found) + ":" + hashlib.sha256(recipe_part.encode()).hexdigest()

    def _machine_key(self) -> str:
        """The machine settings as the memory plan reads them; empty with no plan."""
        if self.memory is None:
            return ""
        try:
            return repr(settings.load())
        except settings.MachineError as exc:  # the sync reports it; a fix means a new sync
            return f"unusable: {exc}"

    def _synced(self) -> Synced | None:
        try:
            data = json.loads(files.read_text(self._stamp, limit=8 * 1024 * 1024))
            models = tuple((m[0], m[1], m[2]) for m in data["models"])
            startup = data.get("startup")
            return Synced(
                data["library"],
                models,
                data["preset"],
                data.get("skipped", ""),
                tuple(startup) if isinstance(startup, list) else None,
                router_memory.load(data.get("startupNeed")),
                data.get("unfit", ""),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _preset_text(self) -> str | None:
        try:
            return files.read_text(self.preset_path, limit=preset.MAX_PRESET)
        except (OSError, ValueError):
            return None

    # -- make ----------------------------------------------------------------------------------

    def make_own(self, what: Prerequisite, ctx: StepContext) -> None:
        if isinstance(what, LibrarySync):
            self._sync(ctx)
        elif isinstance(what, StartupModels):
            self._apply_startup(what, ctx)
        else:
            super().make_own(what, ctx)

    def _sync(self, ctx: StepContext) -> None:
        router = self.recipe.router
        found = library.scan(self.recipe.library.models_path)
        fingerprint = self._sync_key(found)
        try:
            result = gguf_cache.sync(found, self.cache_dir, ctx.progress, ctx.cancel)
        except OSError as exc:
            raise Transient(f"cannot write the GGUF cache {self.cache_dir}: {exc}") from None
        planned = router_memory.plan(
            self.name, self.recipe, result.models, self.cache_dir, self.memory
        )
        offered = [m for m in result.models if m.name in planned.offered]
        names = tuple(model.name for model in offered)
        try:
            preset.check_startup(router.load_on_startup, names, router.models_max)
            startup = startup_models(self.recipe, names)
            text = preset.render(
                [_Section(m.name, m.model_file, m.mmproj_file) for m in offered],
                planned.defaults,
                startup,
                self.recipe.library.container_dir,
                planned.contexts,
            )
        except preset.PresetError as exc:
            raise Permanent(f"{exc}; {result.summary()}") from None
        before = self._preset_text()
        wrote = preset.write(self.preset_path, text)
        skipped = "; ".join(str(b) for b in result.bad)
        synced = {
            "library": fingerprint,
            "preset": text,
            "skipped": skipped,
            "startup": list(startup),
            "models": [[m.name, m.model_file, m.mmproj_file] for m in offered],
            "startupNeed": router_memory.dump(planned.startup),
            "unfit": ", ".join(planned.unfit),
        }
        files.write_atomic(self._stamp, json.dumps(synced).encode(), 0o600)
        ctx.progress(result.summary())
        log.info("library synced", summary=result.summary(), preset_changed=wrote)
        if skipped:
            log.warning("library files skipped", bad=skipped)
        if planned.unfit or planned.unplanned:
            log.warning("memory plan", not_offered=planned.unfit, not_planned=planned.unplanned)
        if wrote:
            self._reload(preset.changed_sections(before, text))

    def _reload(self, changed: tuple[str, ...]) -> None:
        """Ask a running router to re-read its preset; nothing to do when none answers. It
        unloads the models whose sections changed: those of the load-on-startup set are due
        again (the next observation loads them)."""
        with contextlib.suppress(OSError, ValueError, Transient, Permanent):
            self._get("/models?reload=1")
            log.info("router asked to reload its preset", changed=",".join(changed))
            found = self._read_record()
            if found is not None:
                self._record(found[0], found[1], tuple(sorted({*found[2], *changed})))

    def _apply_startup(self, what: StartupModels, ctx: StepContext) -> None:
        """POST /models/unload and /models/load, then wait for the loads to end (loaded or
        failed; a failure is named in the status by the next observation)."""
        for path, names in (("/models/unload", what.unload), ("/models/load", what.load)):
            for name in names:
                ctx.progress(f"{path.rsplit('/', 1)[1]}ing {name} on the running router")
                try:
                    code = router_api.post(self._url(), path, {"model": name})
                except OSError as exc:
                    raise Transient(f"the router did not take {path} for {name}: {exc}") from None
                log.info("router asked", path=path, model=name, answer=code)
                if code >= 500:
                    raise Transient(f"the router answered {code} to {path} for {name}")
        deadline = time.monotonic() + self.ready_timeout
        while what.load and time.monotonic() < deadline:
            states = {model.name: model for model in self._models() or ()}
            if all(_settled(states.get(name)) for name in what.load):
                break
            if ctx.sleep(_LOAD_POLL):
                raise Cancelled("loading the load-on-startup models was cancelled")
        self._record(what.container_id, what.wanted)

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
            return router_api.parse(self._get("/models"))
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

    def targets(self, endpoint: Endpoint) -> tuple[TargetGroup, ...]:
        """One target per loaded model, from this observation's poll of /models."""
        self._listing = self._models()
        address = f"{endpoint.host}:{endpoint.port}"
        common = {
            "__metrics_path__": self.recipe.run.metrics_path,
            "engine": self.kind,
            "name": self.name,
        }
        return router_api.target_groups(self._listing or (), address, common)

    def notes(self) -> str:
        synced = self._synced()
        parts = [router_api.note(self._listing)] if self._listing is not None else []
        if synced and synced.skipped:
            parts.append(f"skipped {synced.skipped}")
        if synced and synced.unfit:
            parts.append(f"not offered (cannot fit even alone): {synced.unfit}")
        return "; ".join(parts)

    def memory_need(self) -> EngineNeed | None:
        synced = self._synced()
        return router_memory.need(self.name, synced.startup_need) if synced is not None else None

    def failed_models(self) -> tuple[str, ...]:
        """The models of the last observation whose load failed (the worker's gauge)."""
        return tuple(model.name for model in router_api.failed(self._listing or ()))

    def private_files(self) -> tuple[Path, ...]:
        return (self._stamp, self.preset_path, self._applied)
