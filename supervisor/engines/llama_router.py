"""llama.cpp's llama-server in router mode: the model library, a local GGUF cache, a preset, and
one router container serving the models (one child process per loaded model)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .. import files, gguf_cache, library, logs, preset
from ..errors import Permanent, Transient
from ..memplan.need import EngineNeed, ModelNeed
from ..plan import Prerequisite
from ..protocol import TargetGroup
from ..recipe import LlamaRouterRecipe
from ..runtime import Runtime
from ..spec import Mount
from . import router_memory
from .base import Endpoint, StepContext
from .container import ContainerEngine, EngineImage, Prerequisites, PulledImage

STARTUP_LABEL: Final = "lucia.router.startup"  # the models it loads at start, comma-joined
_PROBE_TIMEOUT: Final = 2.0
log = logs.get("llama-router")


@dataclass(frozen=True)
class Synced:
    """What the last sync made: the library it saw, the models it cached, the preset it wrote."""

    library: str
    models: tuple[tuple[str, str, str | None], ...]  # (name, model file, mmproj file)
    preset: str
    skipped: str = ""  # the files refused, named for the status message
    startup: tuple[ModelNeed, ...] = ()  # the memory plan's start: what the Check claims
    unfit: str = ""  # models not offered: they cannot fit even alone

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.models)


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

    # -- observe -------------------------------------------------------------------------------

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
        """The library as seen, and the recipe's part of the preset: a change in either means
        a new sync (which copies only what changed) and a new preset."""
        router, where = self.recipe.router, self.recipe.library
        recipe_part = json.dumps(
            [
                router.load_on_startup,
                router.defaults,
                router.models_max,
                where.container_dir,
                str(where.cache_path),
            ],
            sort_keys=True,
            default=str,
        )
        return library_fingerprint(found) + ":" + hashlib.sha256(recipe_part.encode()).hexdigest()

    def _synced(self) -> Synced | None:
        try:
            data = json.loads(files.read_text(self._stamp, limit=8 * 1024 * 1024))
            models = tuple((m[0], m[1], m[2]) for m in data["models"])
            return Synced(
                data["library"], models, data["preset"], data.get("skipped", ""),
                router_memory.load(data.get("startup")), data.get("unfit", ""),
            )  # fmt: skip
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
            text = preset.render(
                [_Section(m.name, m.model_file, m.mmproj_file) for m in offered],
                planned.defaults,
                startup_models(self.recipe, names),
                self.recipe.library.container_dir,
                planned.contexts,
            )
        except preset.PresetError as exc:
            raise Permanent(f"{exc}; {result.summary()}") from None
        wrote = preset.write(self.preset_path, text)
        skipped = "; ".join(str(b) for b in result.bad)
        synced = {
            "library": fingerprint,
            "preset": text,
            "skipped": skipped,
            "models": [[m.name, m.model_file, m.mmproj_file] for m in offered],
            "startup": router_memory.dump(planned.startup),
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
            self._reload()

    def _reload(self) -> None:
        """Ask a running router to re-read its preset; nothing to do when none answers."""
        with contextlib.suppress(OSError, ValueError, Transient, Permanent):
            self._get("/models?reload=1")
            log.info("router asked to reload its preset")

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

    def extra_labels(self) -> dict[str, str]:
        synced = self._synced()
        return {
            STARTUP_LABEL: ",".join(startup_models(self.recipe, synced.names if synced else ()))
        }

    def mounts(self) -> tuple[Mount, ...]:
        return (Mount(str(self.cache_dir), self.recipe.library.container_dir, read_only=True),)

    def _get(self, path: str) -> Any:
        if self.endpoint is None:
            raise OSError("the router's network has not been seen yet")
        url = self.endpoint.url + path
        with urllib.request.urlopen(url, timeout=_PROBE_TIMEOUT) as response:  # noqa: S310
            return json.loads(response.read().decode())

    def ready(self) -> bool:
        """Router mode answers /health before any model loads: ready means every
        load-on-startup model reports loaded in /models. A model that failed fails the start."""
        try:
            listing = self._get("/models")
        except (OSError, ValueError, urllib.error.URLError):
            return False
        synced = self._synced()
        wanted = set(startup_models(self.recipe, synced.names if synced else ()))
        states = {}
        for entry in listing.get("data", []) if isinstance(listing, dict) else []:
            status = entry.get("status") or {}
            if entry.get("id") in wanted and (
                status.get("failed") or status.get("value") == "failed"
            ):
                raise Permanent(
                    f"model {entry['id']} failed to load (exit code "
                    f"{status.get('exit_code', 'unknown')})"
                )
            states[entry.get("id")] = status.get("value")
        return all(states.get(name) == "loaded" for name in wanted)

    def targets(self, endpoint: Endpoint) -> tuple[TargetGroup, ...]:
        return (self.target_group(endpoint, {"model": self.recipe.model or "router"}),)

    def notes(self) -> str:
        synced = self._synced()
        if synced is None:
            return ""
        parts = [f"skipped {synced.skipped}"] if synced.skipped else []
        if synced.unfit:
            parts.append(f"not offered (cannot fit even alone): {synced.unfit}")
        return "; ".join(parts)

    def memory_need(self) -> EngineNeed | None:
        synced = self._synced()
        return router_memory.need(self.name, synced.startup) if synced is not None else None

    def private_files(self) -> tuple[Path, ...]:
        return (self._stamp, self.preset_path)
