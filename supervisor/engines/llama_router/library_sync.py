"""The router's library sync: the GGUF cache and the preset made current with the library.

A sync is due when the library as seen, the recipe's part of the preset or the machine settings
the memory plan divides have changed since the last one, or when the preset on disk is not the
one it wrote. What the last sync made is recorded in <state>/synced.json. The router serves
the preset's models while the last sync is current; until a sync is, it names what that sync
would offer (status.json names a router's models before it ever ran).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from supervisor import logs
from supervisor.engines.base import StepContext
from supervisor.engines.llama_router import gguf_cache, preset, serves
from supervisor.engines.llama_router import memory as router_memory
from supervisor.engines.llama_router.recipe import LlamaRouterRecipe
from supervisor.engines.llama_router.startup import startup_models
from supervisor.errors import Permanent, Transient
from supervisor.library import models as library
from supervisor.library.ggufcheck import Unreadable
from supervisor.library.ggufmeta import BadHeader, read_metadata
from supervisor.memplan import settings
from supervisor.memplan.guard import Guard
from supervisor.memplan.need import ModelNeed
from supervisor.protocol import files

log = logs.get("llama-router")
# what the preset holds beyond the library and the recipe: a new one syncs again (version 2:
# an embedding model's section has `embeddings = true`, and the record its GGUF's pooling)
PRESET_FORMAT: Final = 2


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
    # the pooling each cached model's GGUF declares (serves.py); a model left out: not known
    pooling: Mapping[str, str] = field(default_factory=dict)

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
class _PresetSection:
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


@dataclass(frozen=True)
class LibraryLook:
    """One look at the library, against the last sync."""

    current: bool  # the last sync is current with it: no sync is due
    names: tuple[str, ...]  # the names the router serves (served_names)


def offered_names(found: library.Library) -> tuple[str, ...]:
    """The model names the next sync would offer from this library, by file names alone (reads
    no GGUF file): a file whose header turns out bad, or a model the memory plan finds cannot
    fit even alone, is named until that sync leaves it out of the preset."""
    return tuple(sorted(gguf_cache.library_units(found)[0]))


def served_names(found: library.Library, current: bool, preset_text: str | None) -> tuple[str, ...]:
    """Pure: the names the router serves, in every state: the preset's while the last sync is
    current with the library as found now, else those the next sync would offer (a router
    that never ran, a model Ready since, one Ready no more)."""
    return preset.models(preset_text) if current else offered_names(found)


class Syncer:
    """One router's GGUF cache, preset and record of the last sync."""

    def __init__(
        self, name: str, recipe: LlamaRouterRecipe, guard: Guard | None, state_dir: Path
    ) -> None:
        self.name = name
        self.recipe = recipe
        self.guard = guard
        self.cache_dir = recipe.library.cache_path
        self.preset_path = self.cache_dir / preset.PRESET_NAME
        self.stamp = state_dir / "synced.json"

    def look(self, found: library.Library) -> LibraryLook:
        """Whether the last sync saw this library, recipe and machine and its preset is on
        disk, and the names the router serves with the library as found."""
        synced = self.synced()
        text = self.preset_text()
        current = synced is not None and synced.library == self.key(found) and text == synced.preset
        return LibraryLook(current, served_names(found, current, text))

    def key(self, found: library.Library) -> str:
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
                PRESET_FORMAT,
            ],
            sort_keys=True,
            default=str,
        )
        return library_fingerprint(found) + ":" + hashlib.sha256(recipe_part.encode()).hexdigest()

    def _machine_key(self) -> str:
        """The machine settings as the memory plan reads them; empty with no plan."""
        if self.guard is None:
            return ""
        try:
            return repr(settings.load())
        except settings.MachineError as exc:  # the sync reports it; a fix means a new sync
            return f"unusable: {exc}"

    def synced(self) -> Synced | None:
        try:
            data = json.loads(files.read_text(self.stamp, limit=8 * 1024 * 1024))
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
                _pooling(data.get("pooling")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _pooling(self, cached: Iterable[gguf_cache.CachedModel]) -> dict[str, str]:
        """The pooling each cached model's GGUF declares (its first shard's header); a header
        that cannot be read leaves its model out (not known)."""
        found: dict[str, str] = {}
        for model in cached:
            with contextlib.suppress(BadHeader, Unreadable, OSError):
                found[model.name] = serves.pooling(read_metadata(self.cache_dir / model.model_file))
        return found

    def preset_text(self) -> str | None:
        try:
            return files.read_text(self.preset_path, limit=preset.MAX_PRESET)
        except (OSError, ValueError):
            return None

    def sync(self, ctx: StepContext) -> tuple[str, ...] | None:
        """Sync the cache, plan the memory, write the preset and the record: the preset's
        changed sections when it was rewritten, None when it was already so."""
        router = self.recipe.router
        found = library.scan(self.recipe.library.models_path)
        fingerprint = self.key(found)
        try:
            result = gguf_cache.sync(found, self.cache_dir, ctx.progress, ctx.cancel)
        except OSError as exc:
            raise Transient(f"cannot write the GGUF cache {self.cache_dir}: {exc}") from None
        planned = router_memory.plan(
            self.name, self.recipe, result.models, self.cache_dir, self.guard
        )
        offered = [m for m in result.models if m.name in planned.offered]
        names = tuple(model.name for model in offered)
        pooling = self._pooling(offered)
        try:
            preset.check_startup(router.load_on_startup, names, router.models_max)
            startup = startup_models(self.recipe, names)
            text = preset.render(
                [_PresetSection(m.name, m.model_file, m.mmproj_file) for m in offered],
                planned.defaults,
                startup,
                self.recipe.library.container_dir,
                planned.contexts,
                embeddings=[name for name, said in pooling.items() if serves.pooled(said)],
            )
        except preset.PresetError as exc:
            raise Permanent(f"{exc}; {result.summary()}") from None
        before = self.preset_text()
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
            "pooling": pooling,
        }
        files.write_atomic(self.stamp, json.dumps(synced).encode(), 0o600)
        ctx.progress(result.summary())
        log.info("library synced", summary=result.summary(), preset_changed=wrote)
        if skipped:
            log.warning("library files skipped", bad=skipped)
        if planned.unfit or planned.unplanned:
            log.warning("memory plan", not_offered=planned.unfit, not_planned=planned.unplanned)
        return preset.changed_sections(before, text) if wrote else None


def _pooling(recorded: object) -> dict[str, str]:
    """The record's pooling by model (absent from records of older workers: none known)."""
    if not isinstance(recorded, dict):
        return {}
    return {
        name: said
        for name, said in recorded.items()
        if isinstance(name, str) and isinstance(said, str)
    }
